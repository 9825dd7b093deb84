"""vLLM as a door to the library's stop policies (docs/vllm.md): the optional ``[vllm]`` extra.

    import vllm, specdecpp.vllm
    spec = specdecpp.vllm.speculative_config(draft="path/to/draft", head="heads/next_wrej1_d1", threshold=0.5)
    llm = vllm.LLM(model="path/to/target", speculative_config=spec)

or ``stop_policy=SVIP(0.3)`` / ``FixedK(2)`` / ``OnlineAcceptance(0.7)`` (vLLM's online estimator) instead
of a head, ``load_aware=True`` for each step's lengths by its measured costs (docs/vllm.md), and
``specdecpp.vllm.speculative_config_json(...)`` for ``vllm serve --speculative-config``. ``draft`` may
also be a feature draft (``FeatureDraft.save_pretrained``: vLLM's ``eagle3`` method; a head only the
lag-free one trained on that draft). Nothing here
imports vLLM; the proposer vLLM runs (``specdecpp.vllm.internals``) is registered by the
``vllm.general_plugins`` entry point.
"""

from .acceptance import OnlineAcceptance
from .config import POLICIES, read_policy, speculative_config, speculative_config_json
from .load_aware import StepCosts, choose_lengths
from .version import SUPPORTED, check_version

__all__ = ["POLICIES", "SUPPORTED", "OnlineAcceptance", "StepCosts", "check_version", "choose_lengths", "read_policy",
           "speculative_config", "speculative_config_json"]
