# Sourced by dev/test and dev/up: a ready .venv, the Kafka jars and the Spark driver's class
# archive, from nothing if need be.
# Prints one line and exits when a requirement is missing.
need() { command -v "$1" >/dev/null 2>&1 || { echo "sparkstep: $2" >&2; exit 2; }; }

PYTHON=${PYTHON:-python3}
need "$PYTHON" "Python 3.11+ is required and \`$PYTHON\` is not on PATH: install it or set PYTHON"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "sparkstep: Python 3.11+ is required, $("$PYTHON" --version 2>&1) found: set PYTHON to a newer one" >&2; exit 2; }
need java "Java 17+ is required (Kafka broker, Spark) and \`java\` is not on PATH: install a JDK 17 or newer"
need mvn "Maven is required to install the Kafka broker from Maven Central and \`mvn\` is not on PATH: install it (apt-get install maven)"
# The dashboard test loads the coordinator's page in headless Chromium (Debian's package).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing chromium (Debian's package) for the dashboard test"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends chromium; } >/dev/null \
      || { echo "sparkstep: installing chromium failed: run apt-get install --no-install-recommends chromium" >&2; exit 2; }
  else
    echo "sparkstep: chromium is missing (the dashboard test needs it): install it with sudo apt-get install --no-install-recommends chromium" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.sparkstep-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "== installing sparkstep and its dev extras into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
.venv/bin/sparkstep kafka install
# The Spark driver's class data archive: about 3 s off every runtime start (once, ~40 s). Only
# a speed-up: without it everything runs, so a failure is reported and set-up goes on.
.venv/bin/sparkstep spark-archive || echo "sparkstep: going on without the Spark class archive" >&2
