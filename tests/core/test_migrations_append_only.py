"""Migrations are append-only: an applied migration's file is never changed again.

The history is keyed by version, and a version already recorded is never applied again, so a
database migrated before an edit keeps what the file said then (warned of, never repaired):
edits made to 0041, 0042 and 0043 after they were committed, and a second file numbered 0047,
left databases migrated in between without a function, a column or an index the code needs
(found by an upgrade hunt, 2026-12-06). This ledger makes each change to a migration a
conscious one.

A new migration: add its line. A change to an existing file: write a new migration instead;
only a change of comments, which runs the same statements, may edit one, with the file's old
checksum added to ``SAME_STATEMENTS`` in sokratos_worker/store/migrations.py (databases that
applied the old text are then not warned of) and its line here updated.
"""

from __future__ import annotations

from sokratos_worker.store.migrations import load_migrations

APPLIED = {
    "0001_pgvector": "abe47bf7a4d8c329bfc157ea6cc9d8ae8f767273e5018bc5cbd4f90ee6e6e773",
    "0002_tables": "43d1aa5770e7674b60516e73b8e3e748a713dc1f7b9bf9f4567f17067f33c8de",
    "0003_enqueue_functions": "391b7541812222f857a85d77fdc25b79ea957214096ded965fd6214445e89e1a",
    "0010_email": "08c3718f264e4bc1d68d17d1f9a0f29a8dbf8583f1d4c06e593811feb4704a42",
    "0020_security_definer": "caec6f90b4b1495c5a2f303d3fb503acd332ef1aa4e7a57e3449d8afa1b37c3a",
    "0030_direct_insert_keys": "f6207e106933beddfd7576a84437fd103e2f4815823a676c083aa66949b8cc2b",
    "0031_email_first_check": "fecf4e4c58123b86ee884985c12e89baade1c21dd11d57bcc9173c17eef7e2d6",
    "0032_email_fetch_failures": "b81b619e1ac79ec99fe839add5a6489fb5cd0d944612eb9c3e73e7b3ec4a3f4a",
    "0040_direct_insert_finished_keys": "9062073f8340e3188728a2adc1a1e4349ac03862e008b2f1f9169d58f2b7241c",
    "0041_direct_insert_key_first": "f8823e535d6858af425837c37fdd4ce3d3dbac8e87250e5e721ac5c9b4542732",
    "0042_fresh_item_ids": "767e94ecb08d6d8ba06ef644bbbac5e91c74468b660cf285ff71dc7edc8b6709",
    "0043_email_first_check_cutoff": "ff721312d6c15dc3fe03efe6b6408f4893fbdf35e49e28ae6a8a8a9ddcba6e09",
    "0044_replay_links": "58e7385fe4379c72d5ff8b16f2658058fdde61841c2b016fa1fa231b786d3518",
    "0045_email_uid_fingerprint": "6c94502a57834cf7709d8085aabbd3e8ab5af876a3703a08ab5fbef101fca65a",
    "0046_distillation_one_payload_form": "3f68a2596e69a04edb64afc6c789e1ead62bc41a679a701a09b0d5cf84c2c12b",
    "0047_idempotency_key_unique_index": "1331dccd3a7fce041f8b8681774b198328b3c71a9f881c6e99fa6c6d095cc512",
    "0048_key_lookups_on_their_indexes": "6191a198c420e88a9f85745316fd2a3ba7cc6780143334c296dd39173d25556b",
    "0049_payload_fields_checked_as_the_worker_reads_them": "4788f143c32175033980dc6ae3c60cd3c43e9925f4f66e16e3078b0f1d257ad4",
    "0050_oversized_archive_kept_for_the_claim": "facc892420de3a0810affbe2cb5437402d231ca7dd765e3718b0212c4f783549",
}


def test_no_applied_migration_changed_and_no_number_reused() -> None:
    files = {m.name: m.checksum for m in load_migrations()}
    changed = sorted(name for name in APPLIED if files.get(name, APPLIED[name]) != APPLIED[name])
    assert changed == [], (
        f"migrations changed after they were committed: {changed}; databases that applied them"
        " keep the old text: write a new migration instead (see this module's docstring)"
    )
    removed = sorted(set(APPLIED) - set(files))
    assert removed == [], f"migrations removed or renamed: {removed} (a version is never reused)"
    new = sorted(set(files) - set(APPLIED))
    assert new == [], f"new migrations: add their lines to APPLIED: {new}"
    versions = [m.version for m in load_migrations()]
    assert len(versions) == len(set(versions)), f"a version number used twice: {versions}"
