"""The ComputeDomain's two long-running parts outside the kubelet plugin: the cluster-wide controller
(:mod:`.controller`: DaemonSets, ResourceClaimTemplates, IMEX channel indexes and clique membership) and the
per-node IMEX daemon wrapper (:mod:`.daemon`: its clique entry, ``nvidia-imex`` configs, process and readiness).
Their commands are :mod:`dradriver.commands.compute_domain_controller` and
:mod:`dradriver.commands.compute_domain_daemon`."""
