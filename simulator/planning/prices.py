"""GPU prices for `specgov plan sweep --prices FILE` (YAML).

Form::

    currency: USD          # optional, a label only (default USD)
    gpu_hour:              # what one GPU costs for one hour
      h100: 2.49
      a100-80g: 1.29

GPU names are the catalog's (aliases resolve). Every error names the file and key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_real
from specgov.simulator.catalog import Catalog, CatalogError

__all__ = ["PriceError", "Prices", "load_prices"]

FORM = "a mapping with 'gpu_hour: {<gpu>: <price per GPU-hour>}' and optional 'currency: <text>'"


class PriceError(SpecgovError, ValueError):
    """The prices file is unreadable or malformed; the message names the file and key."""


@dataclass(frozen=True)
class Prices:
    currency: str
    gpu_hour: dict[str, float]  # catalog GPU name -> price of one GPU-hour
    source: str

    def per_gpu_hour(self, gpu: str) -> float:
        if gpu not in self.gpu_hour:
            raise PriceError(
                f"{self.source}: gpu_hour has no price for {gpu!r} (priced: "
                f"{', '.join(sorted(self.gpu_hour)) or 'none'})"
            )
        return self.gpu_hour[gpu]

    def require(self, gpus: Sequence[str]) -> None:
        """Fail before any simulation when a swept GPU has no price."""
        for gpu in gpus:
            self.per_gpu_hour(gpu)


def load_prices(path: Path, catalog: Catalog) -> Prices:
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PriceError(f"prices file {where!r}: {exc.strerror or exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        raise PriceError(f"{where}{at}: not valid YAML; expected {FORM}") from None
    if not isinstance(doc, dict):
        raise PriceError(f"{where}: expected {FORM}, got {type(doc).__name__}")
    unknown = sorted(str(k) for k in doc if k not in ("currency", "gpu_hour"))
    if unknown:
        raise PriceError(f"{where}: unknown key(s) {', '.join(unknown)}; expected {FORM}")
    currency = doc.get("currency", "USD")
    if not isinstance(currency, str) or not currency.strip():
        raise PriceError(f"{where}: currency must be a non-empty text, got {currency!r}")
    table = doc.get("gpu_hour")
    if not isinstance(table, dict) or not table:
        raise PriceError(f"{where}: gpu_hour must be a non-empty mapping; expected {FORM}")
    out: dict[str, float] = {}
    for key, value in table.items():
        try:
            name = catalog.gpu(str(key)).name
        except CatalogError as exc:
            raise PriceError(f"{where}: gpu_hour.{key}: {exc}") from None
        if not is_real(value) or value <= 0:
            raise PriceError(
                f"{where}: gpu_hour.{key} must be a positive number (price per GPU-hour), "
                f"got {value!r}"
            )
        if name in out:
            raise PriceError(f"{where}: gpu_hour.{key}: {name!r} is priced twice")
        out[name] = float(value)
    return Prices(currency=currency.strip(), gpu_hour=out, source=where)
