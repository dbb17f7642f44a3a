"""Device preparers: one per device kind, plugged into the kubelet-plugin batch runner.

Each implements :class:`dradriver.domain.ports.DevicePreparer` (plan, apply with a recorded undo, CDI edits,
idempotent undo, start-up sweep); sharing strategies implement :class:`dradriver.domain.ports.SharingStep`.
Today: :class:`~dradriver.preparers.gpu.FullGpuPreparer` and :class:`~dradriver.preparers.gpu.StaticMigPreparer`
(no side effects: the device exists, preparing it is giving its nodes to the container),
:class:`~dradriver.preparers.shares.SharedDevicePreparer` (consumable shares, each enforced through the device's
MPS control daemon), and the sharing steps :class:`~dradriver.preparers.sharing.ExclusiveUse`,
:class:`~dradriver.preparers.sharing.TimeSlicing` and :class:`~dradriver.preparers.mps.MpsSharing`.
"""
