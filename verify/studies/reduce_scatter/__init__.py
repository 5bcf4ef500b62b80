"""The reduce-scatter study: how reduction error grows with the data-parallel size.

``models`` holds the vectorised reduction models and input distributions, ``reference``
the exact references, ``sweep`` the sweep and its fitted growth, ``render`` the tables
and plot, ``dist`` measures a real process group's collectives under torchrun, and
``cli`` is ``verify accumulation``.
"""
