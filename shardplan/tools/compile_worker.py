"""The child process of exact mode: ``python -m shardplan.tools.compile_worker`` reads a request
(JSON on stdin), compiles the step on this process's simulated devices, and prints the
StepCost (or the diagnostics) as one JSON line. Started by ``shardplan.api.analyze``."""

from __future__ import annotations

import json
import sys

from shardplan.errors import ShardPlanError, Span


def main() -> None:
    req = json.loads(sys.stdin.read())
    try:
        from shardplan.core import targets
        from shardplan.lang.loader import load_sources
        from shardplan.runtime.exact import compile_step, target_mesh
        from shardplan.runtime.model import load_factory

        plan = load_sources(tuple(tuple(s) for s in req["sources"]), mesh=req["mesh"])
        batch = {k: (tuple(s), d) for k, (s, d) in req["batch"].items()}
        target = targets.parse(req.get("target", "cpu"))
        cost = compile_step(
            plan,
            load_factory(req["model"]),
            load_factory(req["step"], what="--step"),
            batch,
            req["optimizer"],
            req["backend"],
            mesh=target_mesh(plan, target) if target.platform != "cpu" else None,
            target=target,
        )
        print(json.dumps({"cost": cost.to_json()}))
    except ShardPlanError as e:
        out = []
        for d in e.diagnostics:
            doc = dict(d.__dict__)
            doc["span"] = d.span.__dict__ if isinstance(d.span, Span) else None
            out.append(doc)
        print(json.dumps({"error": out}))


if __name__ == "__main__":
    main()
