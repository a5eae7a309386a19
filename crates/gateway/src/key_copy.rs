//! What the books need of keys, apart from the gateway: the ledger's key records copied into a
//! shared store, and the random steps the store's versions of its records take.

use tollgate_core::Keeper;
use tollgate_core::keeper::{KeyPut, KeyWrite};

use crate::store::AnyStore;

/// A random step for the store's version of a set of records (see
/// [`tollgate_core::Keeper::write_records`]): an instance that knew an old version does not
/// meet the same number again after the store forgot.
pub(crate) fn step() -> Result<u32, String> {
    let mut b = [0u8; 4];
    getrandom::fill(&mut b).map_err(|e| format!("no randomness for a version step: {e}"))?;
    Ok(u32::from_le_bytes(b))
}

/// Every record of the ledger written into the store where it is behind (at start: a copy an
/// instance that stopped did not write, keys carried over from the older keeping); with
/// `rebuild`, into a store whose loss is not yet lifted. Answers how many were behind.
pub(crate) async fn copy_all(
    ledger: &tollgate_ledger::Ledger,
    shared: &AnyStore,
    rebuild: bool,
) -> Result<usize, String> {
    let records = ledger.key_records().await.map_err(|e| e.to_string())?;
    let how = if rebuild {
        KeyWrite::Rebuild
    } else {
        KeyWrite::Copy
    };
    let mut behind = 0;
    for (id, version, json) in records {
        let step = step()?;
        if shared
            .put_key(&id, (version, &json), how, step)
            .await
            .map_err(|e| e.to_string())?
            == KeyPut::Done
        {
            behind += 1;
        }
    }
    Ok(behind)
}
