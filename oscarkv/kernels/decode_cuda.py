"""Placeholder: the CUDA C++ decode kernel is not built yet."""


def supported(fmt) -> bool:
    return False
