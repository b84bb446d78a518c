"""The one validated configuration of ShadowKV (defaults: the paper's, arXiv 2410.21465 §5.1)."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import check_choice, check_positive_int, check_range

SELECTORS = ("shadowkv", "quest")
HOST_VALUES = ("native", "fp8")


@dataclass(frozen=True)
class ShadowKVConfig:
    """All knobs of ShadowKV.

    * ``rank``: rank of the SVD of a layer's pre-RoPE keys (all KV heads concatenated); at most
      ``kv_heads * head_dim`` of the model (checked when a cache is built for a model).
    * ``chunk_size``: tokens per landmark chunk (the unit of selection and of host transfers).
    * ``sparse_budget``: tokens selected per KV head per decode step; a multiple of ``chunk_size``.
    * ``outlier_chunks``: chunks per KV head whose keys are least like their landmark; kept exact on the device.
      96, twice the paper's 48: on SmolLM2's needle rows it took ShadowKV from 3.0 to 1.0 points under dense at
      budget 512 on the 420 prompts both counts ran (1.7 pooled with a second 420), and at 122K it costs ~50 MB of
      device memory per sequence and no measurable step time (``kvcache/NOTES.md``).
    * ``local_chunks``: the last chunks of the prompt (plus the remainder that does not fill a chunk), kept exact.
    * ``min_prompt_len``: prompts shorter than this (the longest of a batch) stay dense: compression pays only
      when much more than the budget is dropped (the public code's threshold, 4K).
    * ``max_generated``: tokens a compressed cache can append after the prompt (static device buffers).
    * ``host_values``: ``"native"`` (the model's dtype) or ``"fp8"`` (e4m3 with one fp32 scale per token and
      head): half the pinned host bytes.
    * ``selector``: ``"shadowkv"`` (landmark scores, low-rank keys) or ``"quest"`` (the Quest-style baseline:
      chunk min/max bound, exact keys, no outliers, the outlier tokens added to its budget).
    * ``outlier_window_share``: the share of the outlier chunks chosen by the attention the prompt's last
      ``observation_window`` queries pay them (SnapKV's observation window: softmax over the prompt per query
      head, summed over the window and the KV head's group), among the chunks the min-cosine rule did not take.
      0 is the paper's rule. It needs the prompt's queries, which ``generate`` on a transformers model and the
      reference model hand the cache; ``load_prompt`` takes them as ``window_queries``, and without them this
      share goes back to the min-cosine rule. Why half: on SmolLM2's needle rows (GPU, 840 prompts, the same as
      the radius share's) it took ShadowKV from 0.95 points under the Quest-style selector at budget 256 to 1.96
      over it (+1.37 / +0.77 at 512 / 1024), and above dense (``kvcache/NOTES.md``, "The observation window on the
      GPU"). It suits prompts whose question comes last, as chat prompts do (the window already looks for the
      answer); a question about another part of the prompt gets no help from it, only from the min-cosine half.
    * ``outlier_radius_share``: the share of the outlier chunks chosen by the largest chunk radius (among the chunks
      the two rules above did not take). 0 since the window share: the window half measured 2.9 points above
      the radius half at 256 on the same prompts. With the window share 0 and this 0.5 (the default before):
      0.616 / 0.630 / 0.623 at budgets 256 / 512 / 1024, against 0.605 / 0.621 / 0.625 for the paper's rule.
    * ``observation_window``: the number of last prompt queries of ``outlier_window_share`` (32, SnapKV's).
    * ``radius_weight``: λ of the chunk logit ``(q·landmark + λ·‖q‖·r)/√D``, r = the chunk's largest distance
      between a post-RoPE key and its landmark (one fp32 per chunk and KV head beside the landmark's D values).
      0 is the paper's mean-landmark score. Why not 0: a chunk whose one key scores high among seven that score
      low has a low mean, and is missed (a needle digit, a frequent token read by an early-layer head); r keeps
      such chunks in reach. λ = 1 is a true upper bound of the chunk's best logit, and too loose (it prefers any
      spread-out chunk); 0.5 measured best on SmolLM2's needle rows: on the GPU it took ShadowKV from 2.7 / 0.8 /
      1.4 points under the Quest-style selector at budgets 256 / 512 / 1024 to −1.1 / +0.4 / −0.1 (420 prompts;
      ``kvcache/NOTES.md``, "The chunk radius on the GPU").
    """

    rank: int = 160
    chunk_size: int = 8
    sparse_budget: int = 2048
    outlier_chunks: int = 96
    local_chunks: int = 4
    min_prompt_len: int = 4096
    max_generated: int = 1024
    host_values: str = "native"
    selector: str = "shadowkv"
    radius_weight: float = 0.5
    outlier_radius_share: float = 0.0
    outlier_window_share: float = 0.5
    observation_window: int = 32

    def __post_init__(self):
        check_positive_int("rank", self.rank)
        check_positive_int("chunk_size", self.chunk_size)
        check_positive_int("sparse_budget", self.sparse_budget)
        check_positive_int("outlier_chunks", self.outlier_chunks, allow_zero=True)
        check_positive_int("local_chunks", self.local_chunks, allow_zero=True)
        check_positive_int("min_prompt_len", self.min_prompt_len)
        check_positive_int("max_generated", self.max_generated)
        check_choice("host_values", self.host_values, HOST_VALUES)
        check_choice("selector", self.selector, SELECTORS)
        check_range("radius_weight", self.radius_weight, 0.0, 1e3)
        check_range("outlier_radius_share", self.outlier_radius_share, 0.0, 1.0)
        check_range("outlier_window_share", self.outlier_window_share, 0.0, 1.0)
        check_positive_int("observation_window", self.observation_window)
        if self.outlier_radius_share + self.outlier_window_share > 1.0 + 1e-9:
            raise ValueError(f"outlier_window_share: expected at most 1 - outlier_radius_share = "
                             f"{1.0 - self.outlier_radius_share:g} (the two shares split one set of outlier chunks), "
                             f"got {self.outlier_window_share}")
        if self.sparse_budget < self.chunk_size:
            raise ValueError(f"sparse_budget: expected at least one chunk ({self.chunk_size} tokens), "
                             f"got {self.sparse_budget}")
        if self.sparse_budget % self.chunk_size:
            raise ValueError(f"sparse_budget: expected a multiple of chunk_size ({self.chunk_size}), "
                             f"got {self.sparse_budget}")

    @property
    def select_chunks(self) -> int:
        """Chunks selected per KV head per step (the Quest baseline also gets the outliers' share)."""
        if self.selector == "quest":
            return self.sparse_budget // self.chunk_size + self.outlier_chunks
        return self.sparse_budget // self.chunk_size

    @property
    def kept_outlier_chunks(self) -> int:
        return 0 if self.selector == "quest" else self.outlier_chunks

    @property
    def dense_tokens(self) -> int:
        """Prompt tokens per KV head kept exact besides the selection (outliers + local window, no remainder)."""
        return (self.outlier_chunks + self.local_chunks) * self.chunk_size

    def check_model(self, kv_heads: int, head_dim: int) -> None:
        """Raises ValueError naming ``rank`` when it exceeds what the model's keys can have."""
        if self.rank > kv_heads * head_dim:
            raise ValueError(f"rank: expected at most kv_heads*head_dim = {kv_heads}*{head_dim} = "
                             f"{kv_heads * head_dim} for this model, got {self.rank}")
