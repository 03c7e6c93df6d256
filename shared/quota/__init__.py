"""Quota: what a managed ResourceQuota is and what vmquota writes on it — every ``vmquota.io/`` name
(``annotations``), the accounting modes and a quota's policy (``modes``), the quota equation (``equation``), the
enforcer's plan for one quota (``enforcement``), what it reports of a plan (``reports``) and the reservation
guard's content (``guard``)."""
