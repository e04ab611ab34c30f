//! Credentials and region from the AWS shared files, as the AWS CLI and SDKs read them:
//! `~/.aws/credentials` (`AWS_SHARED_CREDENTIALS_FILE`) and `~/.aws/config` (`AWS_CONFIG_FILE`),
//! profile `AWS_PROFILE` or `default`. Used when neither the spec nor the environment gives
//! credentials.

use std::path::PathBuf;

use super::error::ObjectError;
use super::ObjectCredentials;

/// What the shared files say for one profile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Profile {
    pub credentials: Option<ObjectCredentials>,
    pub region: Option<String>,
}

/// `profile`'s credentials from `credentials` (INI text) and region from `config` (INI text,
/// where a profile other than `default` is the section `[profile NAME]`).
pub(crate) fn parse(
    credentials: Option<(&str, &str)>,
    config: Option<(&str, &str)>,
    profile: &str,
) -> Result<Profile, ObjectError> {
    let load = |(path, text): (&str, &str)| {
        ini::Ini::load_from_str(text).map_err(|source| ObjectError::Profile {
            path: path.into(),
            source,
        })
    };
    let mut out = Profile::default();
    if let Some(file) = credentials {
        let ini = load(file)?;
        if let Some(s) = ini.section(Some(profile)) {
            if let (Some(id), Some(secret)) =
                (s.get("aws_access_key_id"), s.get("aws_secret_access_key"))
            {
                out.credentials = Some(ObjectCredentials {
                    access_key_id: id.trim().into(),
                    secret_access_key: secret.trim().into(),
                    session_token: s.get("aws_session_token").map(|t| t.trim().into()),
                });
            }
        }
    }
    if let Some(file) = config {
        let ini = load(file)?;
        let name = if profile == "default" {
            "default".to_string()
        } else {
            format!("profile {profile}")
        };
        out.region = ini
            .section(Some(name.as_str()))
            .and_then(|s| s.get("region"))
            .map(|r| r.trim().to_string());
    }
    Ok(out)
}

/// The profile from this machine's shared files (missing files give nothing).
pub(crate) fn load() -> Result<Profile, ObjectError> {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let file = |var: &str, default: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(default)))
    };
    let read = |p: Option<PathBuf>| {
        p.and_then(|p| {
            std::fs::read_to_string(&p)
                .ok()
                .map(|t| (p.display().to_string(), t))
        })
    };
    let creds = read(file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials"));
    let config = read(file("AWS_CONFIG_FILE", ".aws/config"));
    let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".into());
    parse(
        creds.as_ref().map(|(p, t)| (p.as_str(), t.as_str())),
        config.as_ref().map(|(p, t)| (p.as_str(), t.as_str())),
        &profile,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const CREDS: &str = "[default]\naws_access_key_id = AKID\naws_secret_access_key = SECRET\n\n[archive]\naws_access_key_id=AK2\naws_secret_access_key=S2\naws_session_token=T2\n";
    const CONFIG: &str = "[default]\nregion = eu-west-1\n\n[profile archive]\nregion=us-west-2\n";

    #[test]
    fn object_profile_reads_the_shared_files_like_the_aws_cli() {
        let p = parse(Some(("c", CREDS)), Some(("f", CONFIG)), "default").unwrap();
        let c = p.credentials.unwrap();
        assert_eq!(
            (c.access_key_id.as_str(), c.secret_access_key.as_str()),
            ("AKID", "SECRET")
        );
        assert_eq!(c.session_token, None);
        assert_eq!(p.region.as_deref(), Some("eu-west-1"));
        let p = parse(Some(("c", CREDS)), Some(("f", CONFIG)), "archive").unwrap();
        assert_eq!(p.credentials.unwrap().session_token.as_deref(), Some("T2"));
        assert_eq!(p.region.as_deref(), Some("us-west-2"));
        assert_eq!(
            parse(Some(("c", CREDS)), None, "nobody").unwrap(),
            Profile::default()
        );
        assert!(matches!(
            parse(Some(("c", "[broken\nx")), None, "default"),
            Err(ObjectError::Profile { .. })
        ));
    }
}
