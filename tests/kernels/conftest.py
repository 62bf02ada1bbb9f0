import os

# Kernel tests run the Triton kernels on CPU tensors, which only works under the interpreter; set before any
# module that imports triton decorates its kernels.
os.environ["TRITON_INTERPRET"] = "1"
