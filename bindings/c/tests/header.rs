//! `include/dejavu.h` is generated from the crate's source by cbindgen; this test regenerates it
//! and fails when the checked-in copy differs. `DEJAVU_BLESS=1` rewrites it instead.

use std::path::Path;

#[test]
fn the_checked_in_header_is_up_to_date() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let path = crate_dir.join("include/dejavu.h");
    if std::env::var_os("DEJAVU_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write the header");
        return;
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "include/dejavu.h is out of date: run `DEJAVU_BLESS=1 cargo test -p dejavu-c --test header` and commit it"
    );
}
