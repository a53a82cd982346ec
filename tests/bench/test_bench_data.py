"""`jaxpar bench data`'s measurements of the tokens source (the step timing runs in the bench)."""

from __future__ import annotations

import dataclasses

from jaxpar.bench import data
from jaxpar.config import DataConfig, resolve_recipe
from jaxpar.worker import training


def test_bytes_read_per_process_fall_as_one_over_processes(tokens_corpus):
    cfg = resolve_recipe("gpt_tiny")
    cfg = training.vocab_from_data(
        dataclasses.replace(cfg, data=DataConfig(source="tokens", path=tokens_corpus))
    )
    rates = [data._source_rate(cfg, p, steps=3) for p in data.PROCESSES]
    window_bytes = (cfg.model.seq_len + 1) * 2  # uint16 ids
    for r in rates:
        assert r["rows_per_step"] == 32 // r["processes"]
        assert r["bytes_per_step"] == r["rows_per_step"] * window_bytes
        assert r["examples_per_s"] > 0
