//! [`contract_tests!`](crate::contract_tests): the contract's checks as one
//! `#[test]` each, expanded in the backend's own test file.
//!
//! The list of checks is written once, in `__contract_checks!`; it feeds
//! both the generated tests and [`crate::CHECKS`], and a unit test of this
//! crate compares it with the checks `contract/` defines, so a check
//! added there and not here fails.

/// One `#[test]` per contract check, each on a harness of its own.
///
/// `$harness` is an expression that builds a fresh
/// [`ContractHarness`](crate::ContractHarness) (a call to the test file's
/// builder, usually); it is evaluated once in every generated test, so a
/// builder that uses directories or ports must make them unique per call.
/// Each test is named after its check, so one check runs by name:
///
/// ```text
/// cargo test -p shardq-fs --test contract one_run_per_key
/// ```
///
/// Forms:
///
/// * `contract_tests!(harness())`: every check of [`crate::CHECKS`];
/// * `contract_tests!(harness(), rewind)`: those and the checks of
///   [`crate::REWIND_CHECKS`], for a [`RewindHarness`](crate::RewindHarness);
/// * `..., after = f` (after either form): `f(&harness, check_name)` runs
///   after each check passed, for assertions of the backend's own about
///   the state a check leaves.
#[macro_export]
macro_rules! contract_tests {
    ($harness:expr $(,)?) => {
        $crate::contract_tests!($harness, after = $crate::contract::nothing_after);
    };
    ($harness:expr, rewind $(,)?) => {
        $crate::contract_tests!($harness, rewind, after = $crate::contract::nothing_after);
    };
    ($harness:expr, after = $after:expr $(,)?) => {
        $crate::__contract_checks! { __contract_test_fns (($harness) ($after)) }
    };
    ($harness:expr, rewind, after = $after:expr $(,)?) => {
        $crate::contract_tests!($harness, after = $after);
        $crate::__contract_rewind_checks! { __contract_test_fns (($harness) ($after)) }
    };
}

/// Calls `$crate::$then!` with `$args` followed by the name of every check
/// on a [`ContractHarness`](crate::ContractHarness).
#[doc(hidden)]
#[macro_export]
macro_rules! __contract_checks {
    ($then:ident ($($args:tt)*)) => {
        $crate::$then! {
            $($args)*
            keys_start_in_enqueue_order
            one_run_per_key
            stale_receipts_change_nothing
            lapsed_job_lease_runs_again_and_old_receipt_is_refused
            extend_keeps_a_long_run_alive
            dead_letters_count_as_work
            dead_letters_of_a_sealed_key_stay_as_they_are
            exports_find_every_job_above_a_cursor
            purged_jobs_say_they_moved_away
            an_old_id_finds_its_copy_after_moves
            fences_grow_for_every_new_run
            fail_with_retry_in_runs_again_first
            dedup_ids_belong_to_their_key
            schedule_ticks_store_once
            a_jobs_dedup_id_follows_it_through_claims_and_moves
            unique_jobs_hold_their_id_while_they_wait_or_run
            debounced_jobs_take_the_last_payload_and_run_once
            dedup_is_atomic_with_the_append
            dedup_records_move_with_export_and_import
            backlogs_move_with_their_key
            a_moving_key_freezes_only_once_copied
            jobs_can_be_read_and_cancelled
            a_running_job_cancelled_ends_with_its_run
            a_cancelled_runs_failure_ends_it_at_once
            a_cancelled_run_is_stale_to_a_read_at_once
            a_keys_retry_rule_decides_its_wait
            finished_jobs_are_kept_newest_first
            a_handlers_result_is_kept_with_its_finished_job
            dependents_run_once_after_their_dependencies
            a_batch_fires_each_callback_once
            rate_limits_hold_across_every_claim
            a_backed_off_run_keeps_its_attempt_and_holds_its_key
            a_resumed_key_starts_at_once_and_other_waits_stand
            a_groups_concurrency_caps_its_runs_over_every_shard
            a_keys_concurrency_runs_its_jobs_in_order_that_many_at_once
            lapsed_runs_of_a_concurrent_key_run_again_in_order
            an_ack_batch_with_a_live_and_a_lapsed_run_of_one_key
            a_changed_concurrency_holds_from_the_next_claim
            a_concurrent_keys_starts_share_its_rate
            // Ranking ready keys by priority and weight (on Redis a claim
            // ranks the first keys of the shard's ready list).
            weights_share_slots_and_priorities_go_first
            ranks_compare_across_the_shards_of_a_process
        }
    };
}

/// As `__contract_checks!`, for the checks on a
/// [`RewindHarness`](crate::RewindHarness).
#[doc(hidden)]
#[macro_export]
macro_rules! __contract_rewind_checks {
    ($then:ident ($($args:tt)*)) => {
        $crate::$then! {
            $($args)*
            rewound_store_is_refused
        }
    };
}

/// The generated tests: one per check name.
#[doc(hidden)]
#[macro_export]
macro_rules! __contract_test_fns {
    (($harness:expr) ($after:expr) $($check:ident)*) => {
        $(
            #[test]
            fn $check() {
                let harness = $harness;
                $crate::contract::$check(&harness);
                ($after)(&harness, stringify!($check));
            }
        )*
    };
}

/// The check names, as `&[&str]`.
#[doc(hidden)]
#[macro_export]
macro_rules! __contract_check_names {
    ($($check:ident)*) => {
        &[$(stringify!($check)),*]
    };
}

#[cfg(test)]
mod tests {
    /// The names of the `pub fn`s of `contract/` whose one parameter is a
    /// `&dyn $harness`.
    fn checks_taking(harness: &str) -> Vec<String> {
        let src = [
            include_str!("contract/mod.rs"),
            include_str!("contract/batch.rs"),
            include_str!("contract/dedup.rs"),
            include_str!("contract/flow.rs"),
            include_str!("contract/inspect.rs"),
            include_str!("contract/moves.rs"),
            include_str!("contract/run.rs"),
            include_str!("contract/workflow.rs"),
        ]
        .concat();
        let want = format!("h:&dyn{harness}");
        let mut out = Vec::new();
        for part in src.split("\npub fn ").skip(1) {
            let (name, rest) = part.split_once('(').expect("a parameter list");
            let params: String = rest
                .split_once(')')
                .expect("a closed parameter list")
                .0
                .split_whitespace()
                .collect();
            if params == want {
                out.push(name.trim().to_string());
            }
        }
        out.sort();
        out
    }

    fn sorted(names: &[&str]) -> Vec<String> {
        let mut v: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        v.sort();
        v
    }

    /// Every check `contract/` defines is listed once for the generated
    /// tests, and nothing else is.
    #[test]
    fn the_macros_list_every_check_of_the_contract() {
        let checks = checks_taking("ContractHarness");
        assert!(checks.len() >= 30, "too few checks found: {checks:?}");
        assert_eq!(sorted(crate::CHECKS), checks);
        assert_eq!(sorted(crate::REWIND_CHECKS), checks_taking("RewindHarness"));
        let mut unique = sorted(crate::CHECKS);
        unique.dedup();
        assert_eq!(unique.len(), crate::CHECKS.len(), "a check listed twice");
    }
}
