"""Text environments for agentic RL: protocol, WebShop-style and household envs, the
EnvPool (latency, concurrency cap, timeouts, fault isolation) and an HTTP env server.

Importing this package does not build any catalogue; envs build (and cache) theirs on
first use. It imports the built-in envs, which registers them (see `registry`).
"""

from tidejax.envs.actions import (
    ActionError,
    ParsedActionEnv,
    Tool,
    ToolCall,
    get_action_parser,
    register_action_parser,
)
from tidejax.envs.client import RemoteEnv, RemoteEnvError, RemoteEnvFactory
from tidejax.envs.faults import FaultConfig, FaultInjector, InjectedFault
from tidejax.envs.household import HouseholdConfig, HouseholdEnv, HouseholdExpert, HouseholdGoal
from tidejax.envs.latency import LatencyModel
from tidejax.envs.latency_spec import HOUSEHOLD_LATENCY, WEBSHOP_LATENCY, LatencySpec
from tidejax.envs.policies import (
    Episode,
    RandomPolicy,
    action_format,
    available_actions_text,
    expert_demonstrations,
    format_prompt,
    make_expert,
    run_episode,
)
from tidejax.envs.pool import EnvPool, PoolConfig, PoolStats, local_env_factory
from tidejax.envs.protocol import (
    MalformedObservation,
    Policy,
    StepResult,
    Task,
    TextEnv,
)
from tidejax.envs.registry import (
    EnvSpec,
    env_settings,
    env_types,
    get_spec,
    make_env,
    make_tasks,
    plugin_names,
    register,
    spec_from_class,
)
from tidejax.envs.server import EnvServer, ServerConfig
from tidejax.envs.webshop import WebShopConfig, WebShopEnv, WebShopExpert, parse_action
from tidejax.envs.webshop_catalogue import (
    Catalogue,
    CatalogueConfig,
    Goal,
    Product,
    get_catalogue,
)
from tidejax.envs.webshop_reward import RewardBreakdown, webshop_reward

__all__ = [
    "ActionError",
    "ParsedActionEnv",
    "Tool",
    "ToolCall",
    "get_action_parser",
    "register_action_parser",
    "HOUSEHOLD_LATENCY",
    "WEBSHOP_LATENCY",
    "Catalogue",
    "CatalogueConfig",
    "EnvPool",
    "EnvServer",
    "EnvSpec",
    "Episode",
    "FaultConfig",
    "FaultInjector",
    "Goal",
    "HouseholdConfig",
    "HouseholdEnv",
    "HouseholdExpert",
    "HouseholdGoal",
    "InjectedFault",
    "LatencyModel",
    "LatencySpec",
    "MalformedObservation",
    "Policy",
    "PoolConfig",
    "PoolStats",
    "Product",
    "RandomPolicy",
    "RemoteEnv",
    "RemoteEnvError",
    "RemoteEnvFactory",
    "RewardBreakdown",
    "ServerConfig",
    "StepResult",
    "Task",
    "TextEnv",
    "WebShopConfig",
    "WebShopEnv",
    "WebShopExpert",
    "action_format",
    "available_actions_text",
    "env_settings",
    "env_types",
    "plugin_names",
    "spec_from_class",
    "expert_demonstrations",
    "format_prompt",
    "get_catalogue",
    "get_spec",
    "local_env_factory",
    "make_env",
    "make_expert",
    "make_tasks",
    "parse_action",
    "register",
    "run_episode",
    "webshop_reward",
]
