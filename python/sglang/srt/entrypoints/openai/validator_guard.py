"""Wrong-typed fields that break a request model's "before" validators become 400s.

Upstream's ``ChatCompletionRequest`` and ``CompletionRequest`` run ``model_validator(mode=
"before")`` functions on the raw body before pydantic checks any field's type; they assume the
types (``set_json_schema`` calls ``response_format.get(...)``), so ``"response_format": true``
raises ``AttributeError``, which pydantic does not turn into a validation error: the route
answers 500. :func:`guard_before_validators`, a wrap validator patch 0072 adds last to each
model (so it runs first, around the "before" validators), turns such an exception into the
validation error of the field that has the wrong type, as pydantic would report it without the
"before" validator (``response_format: Input should be a valid dictionary ...``, through patch
0025's messages), or into a plain value error naming the exception when no single field is at
fault. Found by ``test/e2e/test_endpoints_fuzz.py``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pydantic import TypeAdapter, ValidationError

__all__ = ["guard_before_validators"]

# What a "before" validator raises on a value of a type it did not expect.
TYPE_FAULTS = (AttributeError, TypeError, KeyError, IndexError)


def field_type_errors(model: type, values: Any) -> Optional[ValidationError]:
    """The validation error of the first field of ``values`` (a raw request body) that does not
    have ``model``'s type for it, located at that field; None when every present field has its
    type (or ``values`` is not a dict: pydantic reports that itself)."""
    if not isinstance(values, dict):
        return None
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in values:
            continue
        try:
            TypeAdapter(field.annotation).validate_python(values[key])
        except ValidationError as err:
            line_errors = []
            for e in err.errors():
                detail = {"type": e["type"], "loc": (key, *e["loc"]), "input": e["input"]}
                if e.get("ctx"):
                    detail["ctx"] = e["ctx"]
                line_errors.append(detail)
            return ValidationError.from_exception_data(model.__name__, line_errors)
    return None


def guard_before_validators(cls, values: Any, handler: Callable[[Any], Any]) -> Any:
    """Wrap model validator: validate ``values`` with ``handler``; a :data:`TYPE_FAULTS`
    exception from a "before" validator becomes :func:`field_type_errors`'s validation error,
    else a ``ValueError`` naming it (both answered with a 400).

    Raises:
        ValidationError: the field at fault, or what ``handler`` raised.
        ValueError: a type fault no single field explains.
    """
    if not isinstance(values, dict):
        return handler(values)
    try:
        return handler(values)
    except TYPE_FAULTS as e:
        err = field_type_errors(cls, values)
        if err is not None:
            raise err from e
        raise ValueError(f"a field of the request has a wrong type ({e})") from e
