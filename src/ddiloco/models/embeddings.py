"""Which parameters are embeddings: RDA merges them with the plain weighted mean instead of
averaging lengths and directions (docs/design.md §3.8).

Found by tensor, then named as ``named_parameters()`` names it (a tied weight once, under its
first name), so the names match the fragment plan's whatever model wraps whatever.
"""

from __future__ import annotations

from torch import nn

EMBEDDING_GETTERS = ("get_input_embeddings", "get_output_embeddings")  # Hugging Face's


def embedding_names(model: nn.Module) -> set[str]:
    """Parameters of every ``nn.Embedding``, and the input and output embedding weights of
    any submodule that declares them (a Hugging Face ``PreTrainedModel``), tied or not."""
    found: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            found.update(id(p) for p in module.parameters(recurse=False))
        for getter in EMBEDDING_GETTERS:
            weight = getattr(_declared(module, getter), "weight", None)
            if isinstance(weight, nn.Parameter):
                found.add(id(weight))
    return {name for name, p in model.named_parameters() if id(p) in found}


def _declared(module: nn.Module, getter: str) -> object:
    """What ``module.<getter>()`` returns; None when it has no such method or does not say."""
    method = getattr(module, getter, None)
    if not callable(method):
        return None
    try:
        return method()
    except (NotImplementedError, AttributeError, TypeError):  # a base class that leaves it open
        return None
