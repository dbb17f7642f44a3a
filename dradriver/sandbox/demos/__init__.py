"""``dradriver demo``'s scenarios, one module each: :mod:`.basic` (claims, sharing, MIG and MPS on one node;
``--scenario time-slicing`` runs :mod:`.time_slicing` instead), :mod:`.dynamic_mig`, :mod:`.sharing`,
:mod:`.mps` (the MPS step of ``basic``), :mod:`.compute_domain` and :mod:`.compute_domain_tenants`. The
emulators they drive (API server, kubelet, scheduler, nodes) stay in :mod:`dradriver.sandbox`."""
