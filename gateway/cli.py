"""``specsched-gateway [overrides]``: the OpenAI-compatible HTTP gateway in front of a running daemon
(hydra app; config conf/gateway.yaml, schema :class:`~specsched.gateway.config.GatewayConfig`;
``--cfg job`` prints the resolved config)::

    specsched-gateway daemon_endpoint=tcp://127.0.0.1:5555 port=8000
"""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from specsched.gateway.config import GatewayConfig

CONFIG_PATH = "pkg://specsched.conf"
logger = logging.getLogger("specsched.gateway")


def register_configs() -> None:
    ConfigStore.instance().store(group="schema", name="gateway", node=GatewayConfig)


def resolve(cfg: DictConfig) -> GatewayConfig:
    """Composed config -> the validated dataclass. Raises ``ValueError`` naming the bad value."""
    gateway = OmegaConf.to_object(cfg)
    assert isinstance(gateway, GatewayConfig), type(gateway)
    return gateway


def _run(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        gateway = resolve(cfg)
    except ValueError as e:
        sys.exit(f"specsched-gateway: invalid config: {e}")
    import uvicorn

    from specsched.gateway.app import create_app

    logger.info("serving http://%s:%d/v1 for the daemon at %s%s", gateway.host, gateway.port,
                gateway.daemon_endpoint, " (API key required)" if gateway.api_key else "")  # fmt: skip
    uvicorn.run(create_app(gateway), host=gateway.host, port=gateway.port, log_level=gateway.log_level)


def main() -> None:
    register_configs()
    hydra.main(config_path=CONFIG_PATH, config_name="gateway", version_base="1.3")(_run)()
