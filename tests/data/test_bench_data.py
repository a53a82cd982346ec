"""`jaxpar bench data`'s measurements of the tokens source (the step timing runs in the bench)."""

from __future__ import annotations

import dataclasses

from jaxpar import bench_data, trainer
from jaxpar.config import DataConfig, resolve_recipe


def test_bytes_read_per_process_fall_as_one_over_processes(tokens_corpus):
    cfg = resolve_recipe("gpt_tiny")
    cfg = trainer.vocab_from_data(
        dataclasses.replace(cfg, data=DataConfig(source="tokens", path=tokens_corpus))
    )
    rates = [bench_data._source_rate(cfg, p, steps=3) for p in bench_data.PROCESSES]
    window_bytes = (cfg.model.seq_len + 1) * 2  # uint16 ids
    for r in rates:
        assert r["rows_per_step"] == 32 // r["processes"]
        assert r["bytes_per_step"] == r["rows_per_step"] * window_bytes
        assert r["examples_per_s"] > 0
