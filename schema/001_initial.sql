-- The optimizer's memory (docs/ARCHITECTURE.md, "Memory"): what was tried on which deployment, what the
-- sealed evaluator said of it, and the mechanisms that survived. Append-only where it is history.

CREATE TABLE deployments (
    id INTEGER PRIMARY KEY,
    target TEXT NOT NULL,          -- model path, or "embedded"
    drafter TEXT,                  -- algorithm and checkpoint, NULL for AR
    device TEXT NOT NULL,          -- e.g. "NVIDIA H200", "cpu: AMD EPYC ... (2 cores)"
    dtype TEXT NOT NULL,
    load TEXT NOT NULL,            -- e.g. "B=1", "32 streams"
    created_utc TEXT NOT NULL,
    UNIQUE (target, drafter, device, dtype, load)
);

CREATE TABLE rounds (
    id INTEGER PRIMARY KEY,
    deployment_id INTEGER NOT NULL REFERENCES deployments(id),
    number INTEGER NOT NULL,       -- 1, 2, ... within the deployment
    status TEXT NOT NULL CHECK (status IN ('running', 'finished', 'incomplete')),
    started_utc TEXT NOT NULL,
    finished_utc TEXT,
    UNIQUE (deployment_id, number)
);

-- The cost model's gaps at the start of a round: measured minus floor, ranked.
CREATE TABLE gaps (
    id INTEGER PRIMARY KEY,
    round_id INTEGER NOT NULL REFERENCES rounds(id),
    name TEXT NOT NULL,            -- e.g. "verify", "draft", "host overhead"
    measured_ms REAL NOT NULL,
    floor_ms REAL NOT NULL,
    lost_speedup REAL,             -- speedup the gap costs
    rank INTEGER NOT NULL
);

CREATE TABLE directions (
    id INTEGER PRIMARY KEY,
    round_id INTEGER NOT NULL REFERENCES rounds(id),
    gap_id INTEGER REFERENCES gaps(id),
    description TEXT NOT NULL,
    source TEXT NOT NULL           -- "gap", "memory" (validated elsewhere), "agent"
);

CREATE TABLE candidates (
    id INTEGER PRIMARY KEY,
    round_id INTEGER NOT NULL REFERENCES rounds(id),
    direction_id INTEGER REFERENCES directions(id),
    parent_id INTEGER REFERENCES candidates(id),   -- lineage
    agent TEXT NOT NULL,           -- "search", "llm:<model>", "integration", "baseline"
    params TEXT,                   -- JSON profile {"mechanisms": [...], "tunables": {...}}
    patch TEXT,                    -- unified diff, for coding agents
    created_utc TEXT NOT NULL
);

CREATE TABLE mechanisms (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    description TEXT NOT NULL,
    preconditions TEXT NOT NULL,   -- JSON: what a deployment must have for it to apply
    first_candidate_id INTEGER REFERENCES candidates(id)
);

-- The sealed evaluator's verdict on one candidate.
CREATE TABLE validations (
    id INTEGER PRIMARY KEY,
    candidate_id INTEGER NOT NULL REFERENCES candidates(id),
    accepted INTEGER NOT NULL CHECK (accepted IN (0, 1)),
    reason TEXT,                   -- why a rejected one was rejected
    forcing TEXT,                  -- JSON forcing verdict
    exact INTEGER,                 -- forcing was bitwise (CUDA invariant path)
    speedup_median REAL,
    speedup_min REAL,
    speedup_max REAL,
    noise_band REAL,               -- the run-to-run spread the speedup must clear
    commit_sha TEXT,
    created_utc TEXT NOT NULL
);

CREATE TABLE events (
    id INTEGER PRIMARY KEY,
    round_id INTEGER REFERENCES rounds(id),
    kind TEXT NOT NULL,
    detail TEXT,                   -- JSON
    created_utc TEXT NOT NULL
);

CREATE TRIGGER events_append_only_update BEFORE UPDATE ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
CREATE TRIGGER events_append_only_delete BEFORE DELETE ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
CREATE TRIGGER validations_append_only_update BEFORE UPDATE ON validations
BEGIN SELECT RAISE(ABORT, 'validations are append-only'); END;

-- One row per candidate with its deployment, round and verdict: what `memory show` and datasette list.
CREATE VIEW candidate_results AS
SELECT c.id AS candidate, d.target, d.drafter, d.device, d.dtype, d.load, r.number AS round, c.agent,
       c.parent_id AS parent, c.params, v.accepted, v.reason, v.exact, v.speedup_median, v.speedup_min,
       v.speedup_max, v.noise_band, v.commit_sha
FROM candidates c
JOIN rounds r ON r.id = c.round_id
JOIN deployments d ON d.id = r.deployment_id
LEFT JOIN validations v ON v.candidate_id = c.id;

-- Mechanisms with the deployments they were validated on.
CREATE VIEW validated_mechanisms AS
SELECT m.name, m.preconditions, d.target, d.device, d.dtype, d.load, v.speedup_median
FROM mechanisms m
JOIN candidates c ON c.id = m.first_candidate_id
JOIN validations v ON v.candidate_id = c.id AND v.accepted = 1
JOIN rounds r ON r.id = c.round_id
JOIN deployments d ON d.id = r.deployment_id;
