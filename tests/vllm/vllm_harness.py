"""The GPU tests' harness lives in the package (rolloutcore.vllm_harness) so that
`rolloutcore bench cycle --engine vllm` can use it too; this module keeps the tests' import."""

from rolloutcore.vllm_harness import *  # noqa: F401,F403
from rolloutcore.vllm_harness import (  # noqa: F401
    OUT, VLLM_KIT, VLLM_OTHER_SITE, VLLM_SITE, Background, Trainer, Vllm, cached_tokens, http, manifest_digests,
    require_gpu_vllm, site_version, tiny_env, tokens_of)
