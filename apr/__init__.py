"""apr: plan, apply and record language-model pretraining from one YAML file."""

import time as _time

__version__ = "0.1.0"
STARTED_AT = _time.time()  # when this process first imported apr: a run's start-up is measured from here
