# One image for every service of docker-compose.yml: Python 3.11, a Java 17 JRE, sparkstep
# installed in /opt/sparkstep, and the Kafka broker jars `sparkstep kafka` runs.
#
# Built from a standard Python slim base (the BASE build argument; any Debian bookworm image
# works, with or without Python: a bare one gets Debian's python3). Python packages and the
# broker jars come from .build/compose/, made on the host by dev/compose-context, so the build
# itself reaches nothing but Debian's package mirror.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
# The JRE's postinst links man pages; slim images drop /usr/share/man.
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
      $(command -v python3 >/dev/null || echo python3 python3-venv) \
 && rm -rf /var/lib/apt/lists/*

COPY .build/compose/wheels /tmp/wheels
RUN python3 -m venv /opt/sparkstep \
 && /opt/sparkstep/bin/pip install --no-index --find-links /tmp/wheels sparkstep \
 && rm -rf /tmp/wheels /root/.cache
COPY .build/compose/cache /opt/sparkstep-cache

ENV PATH=/opt/sparkstep/bin:$PATH \
    SPARKSTEP_CACHE=/opt/sparkstep-cache \
    PYSPARK_PYTHON=/opt/sparkstep/bin/python
WORKDIR /work

# The Spark driver JVM's class data archive (`sparkstep spark-archive`: two JVMs for about 40 s,
# about 170 MB in the cache): every runtime the coordinator starts, the first and each restart
# or rescale, maps Spark's classes from it instead of loading them (about 3 s less a start, see
# BENCHMARKS.md). The JVMs of the Spark workers are the cluster's own and start without it. If
# it cannot be made, the image has none and runtimes start as they would without it.
RUN sparkstep spark-archive \
 || echo "sparkstep: the image has no class data archive; runtimes start without one"
