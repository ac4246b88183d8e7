"""The GPU tests' harness lives in the package (rolloutcore.vllm_harness) so that
`rolloutcore bench cycle --engine vllm` can use it too; this module keeps the tests' import."""

from rolloutcore.vllm_harness import *  # noqa: F401,F403
from rolloutcore.vllm_harness import OUT, Background, Trainer, Vllm, cached_tokens, http, manifest_digests, tokens_of  # noqa: F401
