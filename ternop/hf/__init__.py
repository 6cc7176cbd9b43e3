"""The Hugging Face bridge: all of ternop's transformers glue.

Importing it registers ``quant_method: "ternary"`` with transformers, after which
``AutoModel.from_pretrained(ternary_dir)`` and ``SentenceTransformer(ternary_dir)`` build
the model with ``ternop.TernaryLinear`` layers. It also loads models for the tools
(:func:`load_model`, :func:`build_layout`), maps names between a model and its checkpoint
(:mod:`ternop.hf.names`) and pools sentence embeddings (:mod:`ternop.hf.embedding`).
"""

from ternop.hf.embedding import embed_model, embed_texts, max_seq_length, pool, pooling_mode, token_ids
from ternop.hf.loading import build_layout, is_causal_lm, load_model, load_tokenizer
from ternop.hf.names import match_names, module_to_checkpoint
from ternop.hf.quantizer import TernaryHfConfig, TernaryHfQuantizer, register, replace_linears

register()

__all__ = [
    "TernaryHfConfig",
    "TernaryHfQuantizer",
    "build_layout",
    "embed_model",
    "embed_texts",
    "is_causal_lm",
    "load_model",
    "load_tokenizer",
    "match_names",
    "max_seq_length",
    "module_to_checkpoint",
    "pool",
    "pooling_mode",
    "register",
    "replace_linears",
    "token_ids",
]
