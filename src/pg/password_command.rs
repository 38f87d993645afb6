//! `--database-password-command`: a program outboxd runs before every PostgreSQL connection to get a fresh
//! password (RDS / Aurora IAM tokens, Cloud SQL and Azure Entra tokens live about 15 minutes). It runs
//! without a shell (the value is split on whitespace: program, then arguments), its standard output is the
//! password (one trailing line break dropped), and neither the output nor the arguments ever reach a log line
//! or an error. Opening connections is `pg`'s and the replication connection's; this module only runs the
//! program.

use std::process::Stdio;
use std::time::Duration;

/// How long the program may take.
const TIMEOUT: Duration = Duration::from_secs(30);

/// A program and its arguments, parsed from `--database-password-command`.
#[derive(Clone, PartialEq, Eq)]
pub struct PasswordCommand {
    program: String,
    args: Vec<String>,
}

// Arguments may hold a secret (a profile, a key): only the program is shown.
impl std::fmt::Debug for PasswordCommand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PasswordCommand")
            .field("program", &self.program)
            .field("args", &format_args!("<{} hidden>", self.args.len()))
            .finish()
    }
}

impl PasswordCommand {
    /// Splits `value` on whitespace into the program and its arguments (no shell, no quoting: a command that
    /// needs either goes into a script).
    pub fn parse(value: &str) -> Result<Self, String> {
        let mut words = value.split_whitespace().map(str::to_string);
        let program = words.next().ok_or_else(|| {
            "--database-password-command is empty; give a program and its arguments, e.g. `aws rds generate-db-auth-token --hostname db.example.com --port 5432 --username outboxd`".to_string()
        })?;
        Ok(PasswordCommand {
            program,
            args: words.collect(),
        })
    }

    /// The program's name, for messages.
    pub fn program(&self) -> &str {
        &self.program
    }

    /// Runs the program and returns the password it printed. Errors name the program and its exit status,
    /// never its output, its standard error or its arguments.
    pub async fn password(&self) -> Result<String, String> {
        let mut command = tokio::process::Command::new(&self.program);
        command
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let program = &self.program;
        let child = command.spawn().map_err(|error| {
            format!("--database-password-command: cannot run {program}: {error} (fix: give the program's full path, and make it executable)")
        })?;
        let output = tokio::time::timeout(TIMEOUT, child.wait_with_output())
            .await
            .map_err(|_| {
                format!(
                    "--database-password-command: {program} did not finish within {}s",
                    TIMEOUT.as_secs()
                )
            })?
            .map_err(|error| format!("--database-password-command: {program}: {error}"))?;
        if !output.status.success() {
            // Its standard error is not shown: helpers echo their arguments (and, traced, their tokens).
            return Err(format!(
                "--database-password-command: {program} failed ({}); run it by hand to see why",
                output.status
            ));
        }
        let password = String::from_utf8(output.stdout).map_err(|_| {
            format!("--database-password-command: {program} printed a password that is not UTF-8")
        })?;
        let password = password
            .strip_suffix('\n')
            .map(|p| p.strip_suffix('\r').unwrap_or(p))
            .unwrap_or(&password);
        if password.is_empty() {
            return Err(format!(
                "--database-password-command: {program} printed no password"
            ));
        }
        if password.contains('\n') {
            return Err(format!("--database-password-command: {program} printed more than one line; it must print the password alone"));
        }
        Ok(password.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_program_and_arguments_and_hides_the_arguments() {
        let command = PasswordCommand::parse("  /bin/echo  --secret  s3cr3t ").unwrap();
        assert_eq!(command.program(), "/bin/echo");
        assert_eq!(command.args, vec!["--secret", "s3cr3t"]);
        let shown = format!("{command:?}");
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert!(PasswordCommand::parse("   ").unwrap_err().contains("empty"));
    }

    #[tokio::test]
    async fn the_password_is_the_output_without_its_line_break() {
        let command = PasswordCommand::parse("printf token-1\\r\\n").unwrap();
        assert_eq!(command.password().await.unwrap(), "token-1");
    }

    #[tokio::test]
    async fn failures_name_the_program_and_never_the_output() {
        let failing = PasswordCommand::parse("sh -c echo_leaked>&2;exit_3").unwrap();
        let error = failing.password().await.unwrap_err();
        assert!(
            error.contains("sh failed") && !error.contains("leaked"),
            "{error}"
        );
        let empty = PasswordCommand::parse("true").unwrap();
        assert!(empty
            .password()
            .await
            .unwrap_err()
            .contains("printed no password"));
        let two_lines = PasswordCommand::parse("printf first\\nsecret-second\\n").unwrap();
        let error = two_lines.password().await.unwrap_err();
        assert!(
            error.contains("more than one line") && !error.contains("secret-second"),
            "{error}"
        );
        let missing = PasswordCommand::parse("/nonexistent/token-helper").unwrap();
        assert!(missing
            .password()
            .await
            .unwrap_err()
            .contains("cannot run /nonexistent/token-helper"));
    }
}
