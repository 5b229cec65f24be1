"""deploy/grafana/expertd-dashboard.json: a well-formed Grafana dashboard whose panels cover what
an operator of expertd needs. That every series and label it queries is really exported by the
server is checked in test_live_server.py."""
from __future__ import annotations

import re

from deploy_manifests import dashboard, dashboard_panels, promql_metrics

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def exprs(panel):
    return [t["expr"] for t in panel["targets"]]


def test_panels_are_well_formed():
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    variables = {v["name"] for v in board["templating"]["list"]}
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
    for panel in dashboard_panels():
        assert panel["datasource"] == DATASOURCE and panel["targets"] and panel["description"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert target["datasource"] == DATASOURCE
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            assert set(re.findall(r"\$(?:\{)?([a-z_]+)", expr)) - {"__rate_interval"} <= variables, expr
            assert promql_metrics(expr), f"{panel['title']}: reads no expertd series"
            for quantile in re.findall(r"histogram_quantile\(([^,]+),\s*sum by \(le[^)]*\)\s*\(rate\((\w+)", expr):
                assert 0 < float(quantile[0]) < 1 and quantile[1].endswith("_bucket"), expr


def test_covers_what_an_operator_watches():
    """Latency, throughput, batch size, queue, per-layer expert-load heat map, imbalance, errors."""
    panels = dashboard_panels()
    read = {name for p in panels for e in exprs(p) for name in promql_metrics(e)}
    assert {"grpc_server_handling_seconds_bucket", "expertd_queue_duration_seconds_bucket",
            "expertd_compute_duration_seconds_bucket"} <= read, "latency"
    assert {"grpc_server_handled_total", "expertd_tokens_total", "expertd_executions_total"} <= read, "throughput"
    assert not {name for name in read if name.startswith("expertd_request")}, "calls are counted by grpc_server_* only"
    assert {"expertd_batch_tokens_sum", "expertd_batch_tokens_count"} <= read, "batch size"
    assert "expertd_pending_requests" in read, "queue"
    assert "expertd_expert_load_imbalance" in read, "imbalance"
    assert any('code!="OK"' in e for p in panels for e in exprs(p)), "errors"
    (heatmap,) = [p for p in panels if p["type"] == "heatmap"]
    assert heatmap["repeat"] == "layer" and "$layer" in heatmap["title"], "one heat map per layer"
    (expr,) = exprs(heatmap)
    assert promql_metrics(expr) == {"expertd_routed_tokens_total": {"job", "layer"}}
    assert "sum by (expert)" in expr, "one heat-map row per expert"
    layer_variable = next(v for v in dashboard()["templating"]["list"] if v["name"] == "layer")
    assert "expertd_routed_tokens_total" in layer_variable["definition"] and layer_variable["includeAll"]
