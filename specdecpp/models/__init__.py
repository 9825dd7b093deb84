"""The documented home of the loading API (README): ``specdecpp.models.load_pair``,
``eos_token_ids``, ``write_output_vocab``, ... keep working from here. The code lives in modules
named for what they hold:

- :mod:`specdecpp.models.loading`: devices, precisions, ``load_config`` / ``load_tokenizer`` /
  ``load_model`` / ``load_pair``, the tokenizer and vocabulary checks, EOS ids;
- :mod:`specdecpp.core.hooks`: ``keep_last``, ``GatherKeptLogits``, ``FinalHidden``, ``new_cache``;
- :mod:`specdecpp.models.reduced_vocab`: ``ReducedOutput`` and the output-vocabulary file;
- :mod:`specdecpp.models.identity`: portable model identities and their resolvers.
"""

from ..core.hooks import FinalHidden, GatherKeptLogits, keep_last, new_cache
from .identity import model_identity, portable_name, register_resolver, resolve_model, same_model
from .loading import (
    check_tokenizers,
    check_vocab,
    cpu_has_native_bf16,
    dtype_name,
    eos_token_ids,
    load_config,
    load_model,
    load_pair,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    token_set,
)
from .reduced_vocab import (
    OUTPUT_VOCAB_FILE,
    ReducedOutput,
    output_vocab_size,
    read_output_vocab,
    restrict_output_vocab,
    write_output_vocab,
)

__all__ = [
    "OUTPUT_VOCAB_FILE", "FinalHidden", "GatherKeptLogits", "ReducedOutput", "check_tokenizers", "check_vocab",
    "cpu_has_native_bf16", "dtype_name", "eos_token_ids", "keep_last", "load_config", "load_model", "load_pair",
    "load_tokenizer", "model_identity", "new_cache", "output_vocab_size", "portable_name", "read_output_vocab",
    "register_resolver", "resolve_device", "resolve_dtype", "resolve_model", "restrict_output_vocab",
    "same_model", "token_set", "write_output_vocab",
]
