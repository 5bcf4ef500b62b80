"""The reduce-scatter study: how reduction error grows with the data-parallel size.

``growth`` holds the vectorised reduction models and the sweep, ``dist`` measures a
real process group's collectives under torchrun, and ``cli`` is ``verify accumulation``.
"""
