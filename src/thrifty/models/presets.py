"""Model sizes for pre-training from scratch with the SmolLM2 tokenizer (vocabulary 49152)."""

from .llama import LlamaConfig

PRESETS = {
    # for CI and smoke tests
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024),
    # ~30M parameters (19M of them the tied embedding)
    "30m": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=2048),
    # ~60M
    "60m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=2048),
    # the SmolLM2-135M shape
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, max_position_embeddings=8192),
    # the Llama-3.2-1B shape (its 128k vocabulary replaced by 49152, tied): ~1.07B parameters, 100.7M of them
    # the embedding; the multi-GPU benchmark's size where FSDP2 sharding lowers the peak memory per GPU
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=8192),
}


def preset(name: str, vocab_size: int = 49152) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=True, rope_theta=10000.0, **PRESETS[name])
