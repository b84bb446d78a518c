"""The tokenizer a corpus is built with: :func:`as_tokenizer` (a ``tokenizers.Tokenizer`` from what the caller
passed, SmolLM2's by default) and :func:`eos_token_of` (the end-of-document token between documents)."""

from __future__ import annotations


def as_tokenizer(tokenizer):
    """A ``tokenizers.Tokenizer`` from one, or from a transformers fast tokenizer; the SmolLM2 one by default."""
    if tokenizer is None:
        from ..pretrained import load_tokenizer

        return load_tokenizer()
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend
    raise TypeError(
        f"tokenizer: expected a tokenizers.Tokenizer or a transformers fast tokenizer, got {type(tokenizer).__name__}"
    )


_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")


def eos_token_of(tokenizer) -> tuple[str, int]:
    """The end-of-document token (name, id) that separates documents in the token files."""
    for tok in _EOS_CANDIDATES:
        tid = tokenizer.token_to_id(tok)
        if tid is not None:
            return tok, tid
    raise ValueError(f"tokenizer: has none of the end-of-text tokens {list(_EOS_CANDIDATES)}")
