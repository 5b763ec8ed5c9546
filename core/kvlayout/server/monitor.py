"""What a server shows people and monitoring: `/stats` (JSON), `/metrics` (Prometheus), the page.

`/stats` joins the worker's snapshot (taken between steps) with the cell
map's latest frame and the observer's counts. `cells.used`/`free`/`capacity`
are the snapshot's; `live_sequences`, `cached` and `shared` are the frame's,
which is at most 0.2 s older (`map_step` says which step it followed; equal
to `steps` once the engine has been idle for 0.2 s).
`/metrics` is the same figures through `prometheus_client` (a collector read
at each scrape; counters for what only grows, gauges for the rest). The
page and the trace template are package data (`kvlayout/server/static/`).
"""

from __future__ import annotations

import functools
from importlib import resources

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

METRICS_TYPE = CONTENT_TYPE_LATEST


def stats(worker, service) -> dict:
    snap, frame, obs = worker.snapshot, worker.frame, worker.observer
    cells = dict(snap["cells"])
    if frame is not None:
        cells.update(live_sequences=len(frame["live"]), cached=frame["cached"], shared=frame["shared"],
                     shared_live=frame["shared_live"])
    else:  # no cell map (a seq layout): one sequence at a time, nothing kept or shared
        cells.update(live_sequences=min(snap["requests"]["running"], 1), cached=0, shared=0, shared_live=0)
    prefix = snap["prefix_cache"]
    return {
        "model": service.model_id,
        "layout": service.cfg.layout.key,
        "cells": cells,
        "kv_bytes": service.job.kv_bytes(cells["used"], cells.get("window_used", 0)).to_json(),  # held now
        "steps": snap["steps"],
        "tokens_per_s": worker.rates_now["tokens_per_s"],
        "prefill_tokens_per_s": worker.rates_now["prefill_tokens_per_s"],
        "queue": dict(snap["requests"]),
        "generated_tokens": snap["generated_tokens"],
        "prefill_tokens": snap["prefill_tokens"],
        "saved_prefill_tokens": prefix["reused_tokens"] if prefix else 0,
        "preemptions": snap["preemptions"],
        # engine.speculate: draft tokens the steps verified, and those kept (both 0 when it is off).
        "drafted_tokens": snap["drafted_tokens"],
        "accepted_tokens": snap["accepted_tokens"],
        "evictions": prefix["evictions"] if prefix else 0,
        "failed_steps": snap["failed_steps"],
        "aborted_steps": obs.aborted_steps if obs is not None else 0,
        "prefix_cache": prefix,
        "map_step": frame["step"] if frame is not None else None,
    }


class Collector:
    """The figures of `stats`, as Prometheus metrics, read at each scrape."""

    def __init__(self, worker, service):
        self.worker, self.service = worker, service

    def collect(self):
        s = stats(self.worker, self.service)
        c, q = s["cells"], s["queue"]
        gauges = [
            ("kvlayout_cells_capacity", "Cells of the cache", c["capacity"]),
            ("kvlayout_cells_used", "Cells some sequence or kept prefix owns", c["used"]),
            ("kvlayout_cells_free", "Cells nobody owns", c["free"]),
            ("kvlayout_cells_cached", "Cells only kept prefixes own", c["cached"]),
            ("kvlayout_cells_shared", "Cells two or more owners (sequences or kept prefixes) hold once", c["shared"]),
            ("kvlayout_cells_shared_live", "Cells two or more live sequences own", c["shared_live"]),
            ("kvlayout_kv_bytes_used", "Bytes of K/V the used cells hold (kv_dtype's)", s["kv_bytes"]["held"]),
            ("kvlayout_window_cells_used", "Cells the sliding-window layers' own table holds (the largest; 0: none)",
             c.get("window_used", 0)),
            ("kvlayout_live_sequences", "Sequences generating or prefilling", c["live_sequences"]),
            ("kvlayout_requests_running", "Requests the engine is generating", q["running"]),
            ("kvlayout_requests_waiting", "Requests in the server's queue", q["waiting"]),
            ("kvlayout_tokens_per_second", "Generated tokens per second over the last 5 s", s["tokens_per_s"]),
            ("kvlayout_prefix_cache_entries", "Kept prefixes", (s["prefix_cache"] or {}).get("entries", 0)),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("kvlayout_steps", "Engine steps (forwards)", s["steps"]),
            ("kvlayout_generated_tokens", "Tokens generated", s["generated_tokens"]),
            ("kvlayout_prefill_tokens", "Prompt tokens prefilled", s["prefill_tokens"]),
            ("kvlayout_saved_prefill_tokens", "Prompt tokens reused from kept prefixes, not prefilled",
             s["saved_prefill_tokens"]),
            ("kvlayout_preemptions", "Sequences preempted", s["preemptions"]),
            ("kvlayout_drafted_tokens", "Draft tokens speculation proposed and the steps verified",
             s["drafted_tokens"]),
            ("kvlayout_accepted_tokens", "Draft tokens the steps verified and kept", s["accepted_tokens"]),
            ("kvlayout_prefix_evictions", "Kept prefixes evicted", s["evictions"]),
            ("kvlayout_failed_steps", "Steps that raised out of the engine", s["failed_steps"]),
            ("kvlayout_aborted_steps", "Cell steps aborted (abort_step)", s["aborted_steps"]),
        ]
        store = (s["prefix_cache"] or {}).get("store")
        if store is not None:  # server.prefix_store: its entries and bytes now, what it did since the start
            yield GaugeMetricFamily("kvlayout_prefix_store_entries", "Prefixes kept on disk", value=store["entries"])
            yield GaugeMetricFamily("kvlayout_prefix_store_bytes", "Bytes of the prefixes kept on disk",
                                    value=store["bytes"])
            counters += [
                ("kvlayout_prefix_store_hits", "Stored prefixes loaded into cells instead of prefilled", store["hits"]),
                ("kvlayout_prefix_store_load_failures", "Stored prefixes that could not be loaded",
                 store["loads_failed"]),
                ("kvlayout_prefix_store_writes", "Prefixes written to disk", store["writes"]),
                ("kvlayout_prefix_store_write_failures", "Prefixes that could not be written", store["write_failures"]),
                ("kvlayout_prefix_store_evictions", "Stored prefixes deleted for the budget", store["evictions"]),
            ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


def metrics_registry(worker, service) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(worker, service))
    return registry


def metrics_text(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


# The cell map's drawing code and style, written once, put into each page where its placeholder is.
SHARED_PARTS = {"/*KVLAYOUT_CELLMAP_JS*/": "cellmap.js", "/*KVLAYOUT_CELLMAP_CSS*/": "cellmap.css"}


def static_text(name: str) -> str:
    return resources.files("kvlayout.server").joinpath("static", name).read_text(encoding="utf-8")


@functools.cache
def page(name: str) -> str:
    """A page of the package's `static/` folder, self-contained: the shared cell map code put in."""
    text = static_text(name)
    for placeholder, part in SHARED_PARTS.items():
        if placeholder in text:
            text = text.replace(placeholder, static_text(part).rstrip("\n"), 1)
    return text
