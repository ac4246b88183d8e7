"""rolloutcore.probes.make_probes on a tiny torch causal LM (skipped without torch), and the
Publisher's attach_probes: probes published with a version come back from the directory."""

from __future__ import annotations

import math

import pytest

from rolloutcore.probes import make_probes

try:
    import torch
except ImportError:  # the torch tests skip; the directory round trip below does not need torch
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

_Module = torch.nn.Module if torch is not None else object


class TinyLM(_Module):
    """Embedding -> mean of the prefix -> linear head: causal, deterministic, cheap."""

    def __init__(self, vocab: int = 32, hidden: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(vocab, hidden, generator=g))
            self.head.weight.copy_(torch.randn(vocab, hidden, generator=g))

    def forward(self, ids):  # [1, seq] -> [1, seq, vocab]
        h = self.embed(ids).cumsum(dim=1) / torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)
        return self.head(h)


@needs_torch
def test_probes_are_the_greedy_continuation_with_top_k() -> None:
    model = TinyLM()
    probes = make_probes(model, [[1, 2, 3], [4, 5]], steps=4, top_k=3)
    assert [p["name"] for p in probes] == ["p0", "p1"]
    for p in probes:
        assert p["top_k"] == 3 and len(p["steps"]) == 4
        tokens = list(p["prompt"])
        for s in p["steps"]:
            logits = model(torch.tensor([tokens]))[0, -1].double()
            lp = torch.log_softmax(logits, -1)
            assert s["token"] == int(torch.argmax(lp))
            assert math.isclose(s["logprob"], float(lp[s["token"]]), abs_tol=1e-6)
            assert s["logprob"] <= 0
            assert len(s["top"]) == 3 and s["top"][0][0] == s["token"]
            assert all(a[1] >= b[1] for a, b in zip(s["top"], s["top"][1:]))
            tokens.append(s["token"])


@needs_torch
def test_bounds_are_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="steps"):
        make_probes(TinyLM(), [[1]], steps=0, top_k=1)
    with pytest.raises(ValueError, match="top_k"):
        make_probes(TinyLM(), [[1]], steps=1, top_k=21)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        make_probes(TinyLM(), [[]], steps=1, top_k=1)


def test_attached_probes_are_stored_with_the_version(cluster, version) -> None:
    import numpy as np

    import rolloutcore

    # What make_probes returns (written out, so this runs without torch).
    probes = [
        {
            "name": "p0",
            "prompt": [1, 2, 3],
            "top_k": 2,
            "steps": [
                {"token": 5, "logprob": -0.5, "top": [[5, -0.5], [7, -1.25]]},
                {"token": 7, "logprob": -0.75, "top": [[7, -0.75], [2, -2.0]]},
            ],
        }
    ]
    with rolloutcore.Publisher(cluster.directory_url, model="probes-model", rank=0, world_size=1) as pub:
        pub.add_shard(version, "w", np.zeros((4, 4), dtype=np.float32), copy=True)
        pub.attach_probes(version, probes)
        assert pub.publish(version)["state"] == "COMMITTED"
        manifest = rolloutcore.DirectoryClient(cluster.directory_url).get("probes-model", version)
        stored = manifest["probes"]
        assert stored[0]["prompt"] == [1, 2, 3]
        assert [s["token"] for s in stored[0]["steps"]] == [s["token"] for s in probes[0]["steps"]]
        bad = [dict(probes[0], top_k=5)]
        with pytest.raises(rolloutcore.InvalidArgumentError, match=r"probes\[0\]"):
            pub.attach_probes(version + "b", bad)
