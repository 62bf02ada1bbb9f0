import os

import torch

# Without CUDA the kernel tests run the Triton kernels on CPU tensors, which only works under the interpreter;
# it must be set before any module that imports triton decorates its kernels. With CUDA they run compiled.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
