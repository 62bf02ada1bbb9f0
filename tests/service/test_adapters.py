"""The LoRA adapter registry: registration through the admin API and the CLI, folders that do not fit
their base refused with the reason, /v1/models lists a tenant's usable adapters with their base as `parent`, and
another tenant's adapter is a 404 exactly like a missing one."""
import json

import pytest
import torch
from safetensors.torch import save_file

from tidepool.service import create_app

from .conftest import ADMIN, Admin

BASE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 256}


def adapter_folder(path, rank=4, modules=("q_proj", "v_proj"), hidden=64):
    path.mkdir(parents=True)
    dims = {"q_proj": (hidden, 64), "v_proj": (hidden, 32), "down_proj": (128, hidden)}
    tensors = {}
    for layer in range(2):
        for m in modules:
            part = "mlp" if m == "down_proj" else "self_attn"
            d_in, d_out = dims[m]
            tensors[f"base_model.model.model.layers.{layer}.{part}.{m}.lora_A.weight"] = torch.ones(rank, d_in)
            tensors[f"base_model.model.model.layers.{layer}.{part}.{m}.lora_B.weight"] = torch.ones(d_out, rank)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                          "target_modules": list(modules)}))
    return str(path)


@pytest.fixture
def setup(sqlite_url, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(BASE))
    app = create_app({"database_url": sqlite_url, "redis_url": None, "storage_dir": str(tmp_path / "storage"),
                      "admin_token": ADMIN, "model": str(base), "max_lora_rank": 8})
    yield app, app.test_client(), Admin(app.test_client()), tmp_path
    app.services.database.dispose()


def test_register_list_refuse_and_visibility(setup):
    app, client, admin, tmp = setup
    mine, mine_h = admin.tenant()
    other, other_h = admin.tenant()
    post = lambda body: client.post("/v1/admin/adapters", json=body, headers=admin.headers)   # noqa: E731
    r = post({"name": "mine-qv", "base_model": "base", "source": adapter_folder(tmp / "a"), "tenant_id": mine})
    assert r.status_code == 201, r.get_json()
    assert r.get_json()["rank"] == 4 and r.get_json()["target_modules"] == ["q_proj", "v_proj"]
    assert post({"name": "shared-d", "base_model": "base", "source": adapter_folder(tmp / "b", 8, ("down_proj",)),
                 "pinned": True}).status_code == 201
    refusals = [
        ({"source": adapter_folder(tmp / "c", 16)}, "rank 16 exceeds max_lora_rank 8"),
        ({"source": adapter_folder(tmp / "d", 4, hidden=32)}, "the base model needs"),
        ({"source": str(tmp / "nowhere")}, "adapter_config.json"),
        ({"base_model": "nope"}, "is not registered"),
        ({"name": "mine-qv"}, "already registered"),
    ]
    for change, why in refusals:
        body = {"name": "x", "base_model": "base", "source": adapter_folder(tmp / "ok-e" / str(len(why))), **change}
        r = post(body)
        assert r.status_code in (400, 404, 409) and why in r.get_json()["error"]["message"], (why, r.get_json())
    assert [a["id"] for a in client.get("/v1/admin/adapters", headers=admin.headers).get_json()["data"]] == \
        ["mine-qv", "shared-d"]
    assert client.patch("/v1/admin/adapters/shared-d", json={"pinned": False},
                        headers=admin.headers).get_json()["pinned"] is False

    def listed(headers):
        return {m["id"]: m.get("parent") for m in client.get("/v1/models", headers=headers).get_json()["data"]}
    assert listed(mine_h) == {"base": None, "mine-qv": "base", "shared-d": "base"}
    assert listed(other_h) == {"base": None, "shared-d": "base"}
    assert client.get("/v1/models/mine-qv", headers=mine_h).get_json()["parent"] == "base"
    leaked, missing = (client.get(f"/v1/models/{m}", headers=other_h) for m in ("mine-qv", "no-such"))
    assert leaked.status_code == missing.status_code == 404
    assert leaked.get_json()["error"]["code"] == missing.get_json()["error"]["code"]
    assert client.patch("/v1/admin/adapters/mine-qv", json={"enabled": False}, headers=admin.headers).status_code == 200
    assert "mine-qv" not in listed(mine_h)


def test_panel_page_registers_and_shows_the_reason(setup):
    import re
    app, client, admin, tmp = setup
    https = {"base_url": "https://localhost"}

    def csrf(html):
        return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)
    page = client.get("/admin/login", **https)
    assert client.post("/admin/login", data={"token": ADMIN, "csrf_token": csrf(page.text)}, **https).status_code == 302
    token = csrf(client.get("/admin/adapters", **https).text)
    bad = client.post("/admin/adapters", data={"csrf_token": token, "name": "big", "base_model": "base",
                                               "source": adapter_folder(tmp / "big", 16)}, **https)
    assert bad.status_code == 400 and "rank 16 exceeds max_lora_rank 8" in bad.text
    ok = client.post("/admin/adapters", data={"csrf_token": token, "name": "small", "base_model": "base",
                                              "source": adapter_folder(tmp / "small"), "pinned": "1"}, **https)
    assert ok.status_code == 303
    listed = client.get("/admin/adapters", **https).text
    assert "small" in listed and "unpin" in listed
    row = client.get("/v1/admin/adapters/small", headers=admin.headers).get_json()
    assert row["pinned"] is True and row["tenant_id"] is None
