"""``vllm-graft serve``'s CPU defaults: oneDNN's primitive cache is capped so that a
server's resident size flattens after a short warm-up; a value the user set is kept."""

from __future__ import annotations

from vllm_graft.cli import main


def test_a_cpu_server_caps_onednn_primitive_cache_unless_set(monkeypatch):
    monkeypatch.setattr(main, "has_gpu", lambda: False)
    environ: dict[str, str] = {}
    main.cpu_server_defaults(environ)
    assert environ == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128"}
    mine = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}
    main.cpu_server_defaults(mine)
    assert mine["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"


def test_a_gpu_server_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr(main, "has_gpu", lambda: True)
    environ: dict[str, str] = {}
    main.cpu_server_defaults(environ)
    assert environ == {}
