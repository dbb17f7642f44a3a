"""The NVML boundary: the only package of dradriver that talks to NVIDIA's management library.

* :mod:`dradriver.nvml.session` loads ``libnvidia-ml.so.1`` (system, explicit path, or the bundled mock) and
  holds one long-lived, initialised session with cached device handles (:func:`~.session.open_session`).
* :mod:`dradriver.nvml.errors` maps every ``nvmlReturn_t`` code to one exception class; NOT_SUPPORTED means
  "feature absent" and reaches callers as ``None``.
* :mod:`dradriver.nvml.discovery` turns what NVML reports into the domain's
  :class:`~dradriver.domain.devices.NodeInventory` (GPUs, MIG devices, fabric clique, failures).
* :mod:`dradriver.nvml.mock` locates the C mock library and its node profiles (tests and ``--mock-profile``).

Everything above this package sees domain objects and :class:`~dradriver.nvml.errors.NvmlError`
subclasses, never pynvml types. Importing the package does not load NVML.
"""
