"""Config schema and loading. Importing this package never imports torch, pyarrow or tokenizers."""

from apr.config.loader import LoadedConfig, SourceMap, config_hash, load_config
from apr.config.schema import AprConfig

__all__ = ["AprConfig", "LoadedConfig", "SourceMap", "config_hash", "load_config"]
