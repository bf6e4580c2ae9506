"""`python -m gemini_jax.serve [overrides]`: the OpenAI-compatible server over one engine.

Hydra reads `conf/server.yaml` of the source checkout (groups model, engine, sparse, tier,
serve). The shipped tiny model is served by default under `serve.model_id`; `weights=<dir>`
serves an HF safetensors checkpoint with its tokenizer.json; a pretrained preset
(`model=smollm2_135m`) serves that GGUF under its name (`gj.list_pretrained()`), its chat
template applied to `/v1/chat/completions` and its EOS ending an answer.
"""

from __future__ import annotations

import logging
import os

import hydra
from omegaconf import DictConfig

from gemini_jax.hydra_schema import one_line_errors

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")


@hydra.main(version_base=None, config_path=CONF, config_name="server")
@one_line_errors
def main(cfg: DictConfig) -> None:
    import uvicorn

    import gemini_jax as gj
    from gemini_jax.config import EngineConfig, ServeConfig
    from gemini_jax.hydra_schema import build
    from gemini_jax.serve.http import create_app

    logging.getLogger("gemini_jax.serve").setLevel(cfg.log_level)
    # Orbax logs each snapshot's save / restore through absl at INFO (dozens of lines per snapshot).
    logging.getLogger("absl").setLevel(cfg.get("library_log_level", "WARNING"))
    from hydra.core.hydra_config import HydraConfig

    from gemini_jax.config import replace
    from gemini_jax.weights.pretrained import pretrained_for_preset

    serve = build(ServeConfig, cfg.serve)
    name = pretrained_for_preset(HydraConfig.get().runtime.choices.get("model") or "")
    if cfg.weights:
        model, tokenizer = gj.load_hf(cfg.weights, dtype=cfg.model.dtype), gj.HFTokenizer(cfg.weights)
    elif name:
        model, tokenizer = gj.load_pretrained(name, dtype=cfg.model.dtype)
        if serve.model_id == ServeConfig().model_id:  # the default id names the tiny model: use the file's name
            serve = replace(serve, model_id=name)
    else:
        model, tokenizer = gj.load_tiny(), gj.ByteTokenizer()
    engine = gj.Engine(model, build(EngineConfig, cfg.engine))
    app = create_app(engine, tokenizer, serve)
    try:
        uvicorn.run(app, host=serve.host, port=serve.port, log_level=str(cfg.log_level).lower())
    finally:
        engine.close()


if __name__ == "__main__":
    from gemini_jax.hydra_schema import register

    register()
    main()
