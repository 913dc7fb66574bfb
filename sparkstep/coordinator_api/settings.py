"""The coordinator's settings: one frozen model, built once at the entry point.

Sources, highest priority first:

1. command line flags (``sparkstep run --workers 3``; only the flags actually given);
2. ``SPARKSTEP_*`` environment variables (``SPARKSTEP_WORKERS=3``; list settings as JSON,
   ``SPARKSTEP_KAFKA_CONFIG='["security.protocol=SSL"]'``);
3. a TOML file given with ``--config`` (top-level keys named like the fields:
   ``workers = 3``, ``kafka_config = ["security.protocol=SSL"]``).

The model is built by :meth:`CoordinatorSettings.load` in :mod:`sparkstep.cli` and then passed
down as an explicit argument: nothing below the entry point reads the environment.

``api_token`` (``SPARKSTEP_API_TOKEN``) protects the REST API only: the runtime's control
endpoint and the workers take a secret the coordinator generates for them at every start
(:class:`~sparkstep.coordinator_api.supervisor.Supervisor`), which REST users never hold. Without a
token the API may only listen on a loopback address (``127.0.0.1``, ``::1``, ``localhost``):
any other ``api_host`` is refused unless ``insecure_no_auth`` says an open API is meant.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from sparkstep.coordinator_api.hosts import parse_state_hosts
from sparkstep.errors import ConfigError
from sparkstep.net import DEFAULT_BIND, is_loopback
from sparkstep.runtime.rescale import CATCHUP_KEYS

__all__ = ["CoordinatorSettings", "RestartStrategyName"]

RestartStrategyName = Literal["fixed-delay", "failure-rate", "none"]

_ENV_PREFIX = "SPARKSTEP_"


class CoordinatorSettings(BaseSettings):
    """Everything ``sparkstep run`` needs; frozen once built.

    Restart strategies (Flink's names and meaning):

    - ``fixed-delay``: after a failure wait ``restart_delay_s`` and restart, at most
      ``restart_attempts`` times in the coordinator's life; then ``failed``.
    - ``failure-rate``: restart after ``restart_delay_s`` as long as fewer than
      ``max_failures_per_interval`` failures happened in the last ``failure_rate_interval_s``
      seconds; then ``failed``.
    - ``none``: the first failure is final.
    """

    model_config = SettingsConfigDict(
        env_prefix=_ENV_PREFIX, frozen=True, extra="ignore", case_sensitive=False
    )

    pipeline: str = Field(description="MODULE:ATTR of the pipeline")
    bootstrap_servers: str = Field(description="Kafka HOST:PORT[,HOST:PORT]")
    state_dir: Path = Field(description="manifest, stores, token file and logs")
    workers: int = Field(default=2, ge=1, le=1024)
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8080, ge=0, le=65535)
    api_token: SecretStr | None = None
    auth_metrics_and_dashboard: bool = False
    insecure_no_auth: bool = False
    name: str | None = None
    checkpoint_interval_s: float = Field(default=60.0, ge=0)  # 0: no timer
    retained_checkpoints: int = Field(default=20, ge=1)
    max_records_per_step: int = Field(default=100_000, ge=1)
    max_bytes_per_step: int = Field(default=256 << 20, ge=1)
    rescale_catchup_keys: int = Field(default=CATCHUP_KEYS, ge=0)
    start_from: Literal["earliest", "latest"] = "earliest"
    on_replay_mismatch: Literal["fail", "reemit"] = "fail"
    input_topics: tuple[str, ...] = ()
    output_topic: str | None = None
    kafka_config: tuple[str, ...] = ()
    spark_master: str | None = None
    # Where the children listen and the host they advertise (sparkstep.net): loopback by
    # default; a cluster binds 0.0.0.0 and advertises a name the other hosts resolve.
    bind: str = DEFAULT_BIND
    advertise: str | None = None
    spark_driver_port: int | None = Field(default=None, ge=1, le=65535)
    spark_block_manager_port: int | None = Field(default=None, ge=1, le=65535)
    py_files: tuple[str, ...] = ()
    # State hosts (sparkstep state-host) to run the workers on; none: the coordinator's own
    # children. HOST:PORT,HOST:PORT on the command line and in SPARKSTEP_STATE_HOSTS, a list in
    # the TOML file. The hosts' token: the first line of state_host_token_file.
    state_hosts: Annotated[tuple[str, ...], NoDecode] = ()
    state_host_token_file: Path | None = None
    restart_strategy: RestartStrategyName = "failure-rate"
    restart_delay_s: float = Field(default=1.0, ge=0)
    restart_attempts: int = Field(default=3, ge=0)
    max_failures_per_interval: int = Field(default=10, ge=1)
    failure_rate_interval_s: float = Field(default=600.0, gt=0)
    start_timeout_s: float = Field(default=600.0, gt=0)
    # One deadline for a whole rescale (pause to resume); the runtime gets what remains of it.
    rescale_timeout_s: float = Field(default=3600.0, gt=0)
    lock_timeout_s: float = Field(default=30.0, gt=0)

    @field_validator("state_hosts", mode="before")
    @classmethod
    def _split_state_hosts(cls, value: Any) -> tuple[str, ...]:
        if isinstance(value, str | list | tuple):
            return parse_state_hosts(value)
        raise ValueError("give HOST:PORT,HOST:PORT")

    @model_validator(mode="after")
    def _state_host_token(self) -> CoordinatorSettings:
        if self.state_hosts and self.state_host_token_file is None:
            raise ValueError(
                "--state-hosts needs --state-host-token-file: the file whose first line is the "
                "token the state hosts were started with (their --token-file)"
            )
        return self

    @model_validator(mode="after")
    def _absolute_state_dir(self) -> CoordinatorSettings:
        if not self.state_dir.is_absolute():
            object.__setattr__(self, "state_dir", self.state_dir.resolve())
        return self

    @model_validator(mode="after")
    def _no_open_api_on_the_network(self) -> CoordinatorSettings:
        if self.api_token is None and not self.insecure_no_auth and not is_loopback(self.api_host):
            raise ValueError(
                f"--api-host {self.api_host} would serve the REST API to the network without a "
                "token: set SPARKSTEP_API_TOKEN, or bind --api-host 127.0.0.1, or pass "
                "--insecure-no-auth to serve it open anyway"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags > environment > TOML file; no .env files, no secrets dir.
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    @staticmethod
    def load(flags: dict[str, Any], config_file: Path | None = None) -> CoordinatorSettings:
        """The settings from ``flags`` (only those given), the environment and ``config_file``.

        Raises :class:`ConfigError` with one line per invalid or missing setting.
        """
        if config_file is not None:
            try:
                with config_file.open("rb") as fh:
                    tomllib.load(fh)
            except OSError as exc:
                raise ConfigError(f"cannot read --config {config_file}: {exc.strerror}") from exc
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"--config {config_file} is not valid TOML: {exc}") from exc

        class _WithFile(CoordinatorSettings):
            model_config = SettingsConfigDict(toml_file=config_file)

        try:
            return _WithFile(**flags)
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from exc


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        if not error["loc"] and error["type"] == "value_error":  # a check of the whole model
            problems.append(str(error["ctx"]["error"]))
            continue
        field = ".".join(str(part) for part in error["loc"]) or "settings"
        flag = "--" + field.replace("_", "-")
        if error["type"] == "missing":
            problems.append(
                f"{field} is missing: pass {flag}, set {_ENV_PREFIX}{field.upper()}, or put "
                f"{field} in the --config file"
            )
        else:
            problems.append(f"{field}: {error['msg']}")
    return "invalid settings: " + "; ".join(problems)
