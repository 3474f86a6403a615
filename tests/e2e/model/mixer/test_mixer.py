"""The mixer axis (lmlab.model.mixer): a token mixer per layer — softmax attention or a recurrent mixer (linear
attention, Gated DeltaNet, Mamba-2) — in a pattern over the layers. Linear attention against its formula token by
token; for every mixer of the registry, alone and in a hybrid pattern: cached generation equal to the full forward
with a state constant in the length, packed documents equal to each alone under attention.doc_mask, the size
estimate, the FLOPs; bad patterns and keys refused by name before anything is built. (Each recurrent mixer's own
formula and transformers parity: tests/unit/model/mixer/test_mixer_<name>.py.)"""

from __future__ import annotations

import pytest


def test_a_hybrid_run_logs_each_layer_s_own_figures_and_resumes_exactly(corpus, tmp_path) -> None:
    """mixer=linear with one attention layer in two, through train.py's path: Ctrl-C at step 17 and resume=true give
    the uninterrupted run's metrics.csv; a linear layer logs its state norm and no attention entropy, the attention
    layer its entropy."""
    import csv

    from tests.runs import straight_and_resumed

    straight, resumed = straight_and_resumed(corpus, tmp_path, "mixer=linear", "mixer.pattern=[linear,attention]",
                                             "position=rope")
    rows = [{int(r["step"]): r for r in csv.DictReader(open(run / "metrics.csv"))} for run in (straight, resumed)]
    columns = [c for c in rows[0][0] if not c.startswith("perf/")]
    assert {"mixer/state_norm/layer_00", "attn/entropy/layer_01"} <= set(columns)
    assert not {"attn/entropy/layer_00", "mixer/state_norm/layer_01"} & set(columns)
    for step, row in rows[0].items():
        for c in columns:
            if row[c] or rows[1][step][c]:
                assert float(rows[1][step][c]) == pytest.approx(float(row[c]), rel=1e-4, abs=1e-6), (step, c)
