"""The pipeline a user defines: inputs with their JSON value schemas, a transform, the output.

A pipeline lives in the user's module and is named on the command line as ``MODULE:ATTR``::

    from pyspark.sql import DataFrame
    from sparkstep import Pipeline, aggregate

    def transform(events: DataFrame) -> DataFrame:
        return aggregate(events, name="sums", key=["key"],
                         aggs={"sum": "sum(value)", "count": "count(*)"})

    pipeline = Pipeline(
        name="keyed_sum",
        inputs={"events": "key string, value long"},
        transform=transform,
        output_key=["key"],
    )

- ``inputs`` maps an input's name to its value schema (Spark DDL or a StructType). The name is
  the parameter of ``transform`` that receives the input's DataFrame, and the default topic
  (``--input-topic NAME=TOPIC``, or just ``TOPIC`` for a one-input pipeline, overrides it).
- ``transform`` is called with one keyword argument per input and returns one DataFrame. It is
  PySpark code: row-wise between sparkstep operators (see :mod:`sparkstep.runtime.plan_check`),
  keeping ``__weight``. It is called again for every step (building a plan is cheap), so it
  must not have side effects.
- ``output_key``: the columns whose values make the output record's key; empty means the whole
  row (the right key for ``distinct``).
- ``shards``: ``S``, the number of key groups, fixed for the life of the pipeline (default 256);
  it bounds the number of state workers.

The output topic's default is ``<name>.out`` (``--output-topic`` overrides it).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkstep.runtime.decode import parse_schema
from sparkstep.runtime.errors import PipelineDefinitionError
from sparkstep.runtime.layout import DEFAULT_SHARDS

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = ["Pipeline", "load_pipeline", "resolve_topics"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
_MAX_SHARDS = 65_536


@dataclass(frozen=True)
class Pipeline:
    """A sparkstep pipeline; see the module docstring."""

    name: str
    inputs: Mapping[str, str | StructType]
    transform: Callable[..., DataFrame]
    output_key: Sequence[str] = ()
    shards: int = DEFAULT_SHARDS

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise PipelineDefinitionError(
                f"pipeline name {self.name!r} must be letters, digits, '.', '_' or '-' "
                "(it names Kafka topics and the transactional id)"
            )
        if not self.inputs:
            raise PipelineDefinitionError(f"pipeline {self.name!r} has no inputs")
        if not 1 <= self.shards <= _MAX_SHARDS:
            raise PipelineDefinitionError(
                f"pipeline {self.name!r}: shards must be between 1 and {_MAX_SHARDS}"
            )
        self._check_transform_signature()

    def _check_transform_signature(self) -> None:
        try:
            signature = inspect.signature(self.transform)
        except (TypeError, ValueError):
            return  # builtins and some callables have no signature: checked when called
        try:
            signature.bind(**{name: None for name in self.inputs})
        except TypeError as exc:
            raise PipelineDefinitionError(
                f"pipeline {self.name!r}: transform must accept the inputs "
                f"{sorted(self.inputs)} as keyword arguments: {exc}"
            ) from exc

    def schema(self, name: str) -> StructType:
        """The value schema of input ``name``, parsed (needs an active SparkSession for DDL)."""
        return parse_schema(self.inputs[name])

    def build(self, inputs: Mapping[str, DataFrame]) -> DataFrame:
        """The output DataFrame of ``transform`` over ``inputs`` (one per input name)."""
        from pyspark.sql import DataFrame

        out: Any = self.transform(**inputs)
        if not isinstance(out, DataFrame):
            raise PipelineDefinitionError(
                f"pipeline {self.name!r}: transform returned {type(out).__name__}, not a DataFrame"
            )
        return out


def load_pipeline(target: str) -> Pipeline:
    """The :class:`Pipeline` named by ``MODULE:ATTR`` (the ``--pipeline`` flag)."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise PipelineDefinitionError(
            f"--pipeline {target!r} must be MODULE:ATTR, e.g. sparkstep.examples.keyed_sum:pipeline"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PipelineDefinitionError(
            f"cannot import the pipeline module {module_name!r}: {exc}"
        ) from exc
    except Exception as exc:  # the user's module raised while it was imported
        raise PipelineDefinitionError(
            f"importing the pipeline module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    pipeline = getattr(module, attr, None)
    if not isinstance(pipeline, Pipeline):
        raise PipelineDefinitionError(
            f"{target} is {type(pipeline).__name__}, not a sparkstep Pipeline"
        )
    return pipeline


def resolve_topics(pipeline: Pipeline, overrides: Sequence[str]) -> dict[str, str]:
    """Input name -> topic, from the defaults and ``--input-topic`` values.

    Each override is ``NAME=TOPIC``, or a bare ``TOPIC`` when the pipeline has one input.
    """
    topics = {name: name for name in pipeline.inputs}
    for item in overrides:
        name, sep, topic = item.partition("=")
        if not sep:
            if len(pipeline.inputs) != 1:
                raise PipelineDefinitionError(
                    f"--input-topic {item!r}: pipeline {pipeline.name!r} has inputs "
                    f"{sorted(pipeline.inputs)}: write NAME=TOPIC"
                )
            name, topic = next(iter(pipeline.inputs)), item
        if name not in topics:
            raise PipelineDefinitionError(
                f"--input-topic {item!r}: pipeline {pipeline.name!r} has no input {name!r} "
                f"(its inputs: {sorted(pipeline.inputs)})"
            )
        topics[name] = topic
    if len(set(topics.values())) != len(topics):
        raise PipelineDefinitionError(f"two inputs read the same topic: {topics}")
    return topics
