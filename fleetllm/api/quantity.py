"""Kubernetes quantities ("24Gi", "500m", 4): the pattern the CRD checks and their value."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import Field

QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[KMGTPE]i?|[mkunM])?$"

Quantity = Annotated[
    str | int,
    Field(json_schema_extra={"x-kubernetes-int-or-string": True}),
]

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


def parse_quantity(value: str | int) -> Decimal:
    """A Kubernetes quantity ("24Gi", "500m", "1e3", 4) as a number."""
    text = str(value).strip()
    match = re.match(r"^([+]?[0-9.]+(?:[eE][-+]?[0-9]+)?)([a-zA-Z]*)$", text)
    if not match or not re.match(QUANTITY_PATTERN, text):
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    number, suffix = match.groups()
    try:
        amount = Decimal(number)
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from None
    if suffix in _BINARY:
        return amount * _BINARY[suffix]
    if suffix in _DECIMAL:
        return amount * Decimal(_DECIMAL[suffix])
    if suffix:
        raise ValueError(f"{value!r} has an unknown suffix {suffix!r}")
    return amount
