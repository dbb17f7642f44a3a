"""The kubelet-plugin layer every dradriver kubelet plugin is made of, parametrised by a driver identity.

``runner`` (the batch runner over device preparers: node-wide lock, group commits, the prepare phases,
unprepare, start-up recovery, orphan sweep), ``lifecycle`` (ordered start steps, stopped in reverse), ``guard``
(the device-plugin guard). The claim state lives in :mod:`dradriver.host.claimstate`, the gRPC servers in
:mod:`dradriver.server`, the ResourceSlice publisher and claim fetch in :mod:`dradriver.kube`; the binaries are
composed from them in :mod:`dradriver.app`.
"""
