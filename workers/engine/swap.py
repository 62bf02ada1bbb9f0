"""The host pool that swapped-out KV blocks wait in: one tensor [layer, k/v, block, block_size, heads, dim],
pinned on CUDA. The block manager decides which blocks move; this copies them."""
import torch


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the copies can move it: fp8 caches as their bytes (torch has no fp8 index_copy_)."""
    return cache.view(torch.uint8) if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else cache


class HostKVPool:
    def __init__(self, layers, num_blocks: int):
        self.layers = layers              # modules whose self_attn holds k_cache and v_cache
        cache = layers[0].self_attn.k_cache
        self.device = cache.device
        self.num_blocks = num_blocks
        self.cache = torch.zeros((len(layers), 2, num_blocks, *cache.shape[1:]), dtype=_raw(cache).dtype,
                                 pin_memory=self.device.type == "cuda")

    @torch.inference_mode()
    def copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Device -> host for swap_out (device, host) pairs first, then host -> device for swap_in (host, device):
        a device block freed by a swap-out may be the target of a swap-in in the same step."""
        if swap_out:
            dev, host = (torch.tensor(ids) for ids in zip(*swap_out))
            dev = dev.to(self.device)
            for i, layer in enumerate(self.layers):
                for j, cache in enumerate((layer.self_attn.k_cache, layer.self_attn.v_cache)):
                    self.cache[i, j].index_copy_(0, host, _raw(cache).index_select(0, dev).cpu())
        if swap_in:
            host, dev = (torch.tensor(ids) for ids in zip(*swap_in))
            dev = dev.to(self.device)
            for i, layer in enumerate(self.layers):
                for j, cache in enumerate((layer.self_attn.k_cache, layer.self_attn.v_cache)):
                    _raw(cache).index_copy_(0, dev, self.cache[i, j].index_select(0, host).to(self.device))


@torch.inference_mode()
def copy_blocks(layers, pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write of forked sequences: device block src -> dst, every layer's K and V (all reads first)."""
    cache = layers[0].self_attn.k_cache
    src, dst = (torch.tensor(ids, device=cache.device) for ids in zip(*pairs))
    for layer in layers:
        for cache in (_raw(layer.self_attn.k_cache), _raw(layer.self_attn.v_cache)):
            cache.index_copy_(0, dst, cache.index_select(0, src))
