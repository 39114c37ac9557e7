"""Make every unpickling path raise: pickle.Unpickler / load / loads (and their C versions) and torch.load with
weights_only=False. A checkpoint load under install() proves that it unpickles nothing."""

import pickle

import torch


class Unpickled(AssertionError):
    pass


def _refuse(*args, **kwargs):
    raise Unpickled("something was unpickled")


class _RefusingUnpickler:
    def __init__(self, *args, **kwargs):
        _refuse()


def install(patch=None) -> None:
    """patch: pytest's monkeypatch.setattr (undone after the test); default: setattr for the process's lifetime."""
    import _pickle

    patch = patch or setattr
    for module in (pickle, _pickle):
        patch(module, "Unpickler", _RefusingUnpickler)
        patch(module, "load", _refuse)
        patch(module, "loads", _refuse)
    real_load = torch.load

    def guarded_load(*args, weights_only=None, **kwargs):
        if weights_only is False:
            _refuse()
        return real_load(*args, weights_only=True, **kwargs)

    patch(torch, "load", guarded_load)
    patch(pickle, "_Unpickler", _RefusingUnpickler)
