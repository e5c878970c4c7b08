"""torch.cuda.nccl: sandbox stand-in (PyTorch 2.9.1+cu128 ships NCCL 2.27.5)."""


def version():
    return (2, 27, 5)


def is_available(tensors=None):
    return True
