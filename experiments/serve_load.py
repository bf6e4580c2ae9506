"""Serving under load over loopback HTTP (`gemini_jax.bench.serve_load`: what it measures, its flags).

    python experiments/serve_load.py [--levels 1,4,16,64] [--prompt 4096] [--skip-flood] ...
"""

from gemini_jax.bench.serve_load import main

if __name__ == "__main__":
    main()
