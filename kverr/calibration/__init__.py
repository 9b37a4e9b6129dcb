"""Calibration: choose a format per layer, kv head and K|V under a memory budget.

* :mod:`.candidates` -- the candidate formats and model-wide outer options, exact bytes per head;
* :mod:`.objective` -- predicted damage from the error decomposition on a capture;
* :mod:`.sensitivity` -- measured per-layer sensitivity (next-token KL per relative error);
* :mod:`.knapsack` -- exact multiple-choice knapsack, whole Pareto frontier in one pass;
* :mod:`.config` -- :class:`CalibrationConfig`, every option of a calibration (versioned JSON);
* :mod:`.search` -- :func:`calibrate` ties them together (layers scored by dask) and writes
  provenance;
* :mod:`.target` -- calibration for a serving engine (vLLM): only what it serves, the same
  objective; the projection of any config onto it.

What the engines serve, and the files they read, are in :mod:`kverr.engines`.
"""

from .candidates import OuterOption, candidate_set, candidates_for_budget, default_candidates, head_bytes
from .knapsack import Frontier, brute_force, solve
from .objective import OBJECTIVE_DOC, OBJECTIVE_KL_DOC, OBJECTIVE_KL_NAME, OBJECTIVE_NAME, OBJECTIVES, predict
from .sensitivity import Sensitivity, measure_sensitivity, sensitivity_for_capture
from .config import CalibrationConfig
from .search import DEFAULT_OPTIONS, Calibration, Scores, Search, WindowsPerHead, calibrate, check_model_matches, score

__all__ = [
    "Calibration", "CalibrationConfig", "DEFAULT_OPTIONS", "Frontier", "OBJECTIVES", "OBJECTIVE_DOC", "OBJECTIVE_KL_DOC",
    "OBJECTIVE_KL_NAME", "OBJECTIVE_NAME", "OuterOption", "Scores", "Search", "Sensitivity", "WindowsPerHead", "measure_sensitivity",
    "sensitivity_for_capture", "brute_force", "calibrate", "candidate_set", "candidates_for_budget",
    "check_model_matches", "default_candidates",
    "head_bytes", "predict", "score", "solve",
]
