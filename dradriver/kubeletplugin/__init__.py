"""The kubelet-plugin layer every dradriver kubelet plugin is made of, parametrised by a driver identity.

``runner`` (the batch runner over device preparers: node-wide lock, group commits, the prepare phases,
unprepare, start-up recovery, orphan sweep), ``lifecycle`` (ordered start steps, stopped in reverse), ``guard``
(the device-plugin guard), ``driverstate`` (the NVIDIA driver usable or not and why: its absence, its return and a
reload under the running plugin), ``devicestatus`` (KEP-4817 ``ResourceClaim.status.devices``), ``nodepolicy``
(the GPU plugin's per-node device policy, applied live), ``refresher`` (devices re-read after dynamic MIG
changes), ``adoption`` and ``cdadoption`` (claims taken over from NVIDIA's checkpoint), ``rollback`` (the
checkpoint written for NVIDIA's plugin), ``reconcile`` (the stale-claim cleanup), ``payload`` (what the claim
state stores for a prepared claim) and ``fairlock`` (the first-come, first-served node-wide lock). The claim state
lives in :mod:`dradriver.host.claimstate`, the gRPC servers in :mod:`dradriver.server`, the ResourceSlice
publisher and claim fetch in :mod:`dradriver.kube`; the binaries are composed from them in :mod:`dradriver.app`.
"""
