"""The recall tier as the cache's extension (``mlx_stream.cache.extension``): registered
when ``mlx_stream.recall`` is imported, so any ``RecallSpec`` a cache is asked to build
with finds it. The heavy modules are imported at first use."""

from __future__ import annotations

from typing import Any

from mlx_stream.errors import Unsupported, UserError
from mlx_stream.recall.names import KEY, tier_of


class RecallExtension:
    name = "recall"
    key = KEY

    def check(self, model, caches: list, verdict, spec) -> Any:
        from mlx_stream.recall.checks import check

        r = spec.recall
        slack = check(model, caches, verdict, r, spec.window, spec.stride, spec.positions,
                      spec.slack)  # fmt: skip
        return spec.replace(slack=slack)

    def attach(self, spec, caches: list) -> None:
        from mlx_stream.recall.tier import attach

        attach(spec.recall, caches)

    def of(self, caches: list) -> Any:
        return tier_of(caches)

    def stage(self, path, state, mode: int | None) -> Any:
        from mlx_stream.recall.persist import stage

        return stage(path, state, mode)

    def drop(self, path) -> None:
        from mlx_stream.recall.persist import drop

        drop(path)

    def admit(self, path, binding: str | None, setting: Any, model) -> None:
        if binding is None and setting not in (None, "saved"):
            raise UserError(f"{path}: saved without a recall store; this run has --recall")
        if binding is not None and setting is None:
            raise UserError(f"{path}: saved with a recall store; this run has no --recall")
        if binding is not None and model is None:
            raise Unsupported(f"{path}: its recall store needs the model to be loaded with")

    def restore(self, path, binding: str, model, raw: list, verdict, caches: list,
                setting: Any) -> None:  # fmt: skip
        from mlx_stream.recall.persist import restore

        restore(path, binding, model, raw, verdict, caches, setting)
