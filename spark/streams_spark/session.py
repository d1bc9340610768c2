"""`register`: make ``format("streams")`` available in a SparkSession, safely for queries that
start at the same time.

Spark (4.x) gives every query and every task of a registered Python data source the same
environment map: a plain ``java.util.HashMap`` held by the registration. Each streaming
query's source runner (``PythonStreamingSourceRunner.init``) puts four entries into that map
when the query starts. Two queries starting at once insert into it from two threads, and a
lost update can leave the map inconsistent for good (its size no longer its number of
entries); every task serialized with it afterwards fails to deserialize
(``java.io.OptionalDataException`` in ``HashMap.readObject``), in every query of the format,
until the driver restarts. Once the four keys are in the map, a start only replaces values,
which changes nothing a concurrent reader (a task being serialized) can see inconsistently.
So `register` puts them in, while nothing runs (classic Spark only: through Spark Connect the
registration lives in the server's JVM; start one query and wait for it to be active before
starting the others together).
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from .sink import StreamsDataSource  # the source's class, with the sink's write methods

__all__ = ["RUNNER_ENVIRONMENT_KEYS", "register"]

log = logging.getLogger("streams.spark")

#: What ``PythonStreamingSourceRunner.init`` puts into the registration's environment map.
RUNNER_ENVIRONMENT_KEYS = (
    "SPARK_LOCAL_DIRS",
    "SPARK_AUTH_SOCKET_TIMEOUT",
    "SPARK_BUFFER_SIZE",
    "SPARK_PYTHON_RUNTIME",
)


def register(spark: Any) -> None:
    """Make ``format("streams")`` available in this Spark session (see the module doc)."""
    spark.dataSource.register(StreamsDataSource)
    _fill_runner_environment(spark)


def _fill_runner_environment(spark: Any) -> bool:
    """Put the source runner's keys into the registration's environment map now; False where
    the JVM is out of reach (Spark Connect). The values are placeholders, the defaults of the
    Python side: the runner replaces each with its own before it starts a worker, and other
    runners and executors put their own before use."""
    jsession = getattr(spark, "_jsparkSession", None)
    if jsession is None:
        return False
    conf = spark.sparkContext.getConf()
    values = {
        "SPARK_LOCAL_DIRS": os.environ.get("SPARK_LOCAL_DIRS", tempfile.gettempdir()),
        "SPARK_AUTH_SOCKET_TIMEOUT": os.environ.get("SPARK_AUTH_SOCKET_TIMEOUT", "15"),
        "SPARK_BUFFER_SIZE": str(conf.get("spark.buffer.size", "65536")),
        "SPARK_PYTHON_RUNTIME": "PYTHON_WORKER",
    }
    try:
        manager = jsession.sessionState().dataSourceManager()
        env = manager.lookupDataSource(StreamsDataSource.name()).dataSourceCls().envVars()
        for key in RUNNER_ENVIRONMENT_KEYS:
            if not env.containsKey(key):
                env.put(key, values[key])
    except Exception:  # another Spark version: the source works, the race stays Spark's
        log.warning(
            "streams_spark.register: could not prepare the data source's environment map; "
            "start streaming queries one after another",
            exc_info=True,
        )
        return False
    return True
