"""hybrid.ops: the kernels tier. Gated DeltaNet (fla's convention and [B, T, H, D] layout) and softmax
attention; each fast op has a naive twin with the same argument order. Importing this package imports neither
fla nor flash_attn (they load lazily inside the functions that use them).

    chunk_gated_delta_rule      fla chunk kernel on CUDA if fla imports, else the PyTorch chunked twin
    recurrent_gated_delta_rule  naive twin: plain loop over positions (also the decode step)
    gated_delta_rule            explicit backend choice ("auto", "torch_chunk", "torch_recurrent", "fla_chunk",
                                "fla_recurrent")
    attention                   softmax attention ("auto", "flash", "sdpa", "eager"), GQA, q_offset for decoding
    attention_eager             its naive twin
    decode_attention            one query per row over a KV buffer with per-row lengths ("triton" split-KV, "torch")
    gdn_qk_prologue             GDN q/k RMSNorm + RoPE + l2norm ("auto", "torch" twin, "triton" fused fwd+bwd)
    decode_linear               F.linear for a decode step's few rows ("triton" GEMV, "torch" = F.linear)

The forward-only kernels of decoding run as ``torch.library`` custom ops while torch.compile traces them (eager
calls launch the kernels directly), so a compiled decode step stays one graph:
``torch.ops.hybrid.decode_attention``, ``.gdn_qk_prologue`` (no gradient needed),
``.fla_recurrent_gated_delta_rule``, ``.gdn_decode_step`` (hybrid.ops.gdn_decode; writes its state in place) and
``.decode_linear`` (hybrid.ops.gemv). Their CUDA kernels are the Triton / fla kernels, their CPU kernels the twins
(``hybrid.ops.utils.custom_ops_on_cpu()`` routes CPU tensors through them, for tests). Triton / fla / flash-attn
availability is cached and a constant under torch.compile.
"""
from hybrid.ops.attention import attention, attention_eager
from hybrid.ops.decode_attention import decode_attention
from hybrid.ops.gdn import chunk_gated_delta_rule, fla_available, gated_delta_rule
from hybrid.ops.gdn_chunk import chunk_gated_delta_rule as torch_chunk_gated_delta_rule
from hybrid.ops.gdn_recurrent import recurrent_gated_delta_rule
from hybrid.ops.gemv import decode_linear
from hybrid.ops.prologue import gdn_qk_prologue

__all__ = [
    "attention",
    "attention_eager",
    "chunk_gated_delta_rule",
    "decode_attention",
    "decode_linear",
    "fla_available",
    "gated_delta_rule",
    "gdn_qk_prologue",
    "recurrent_gated_delta_rule",
    "torch_chunk_gated_delta_rule",
]
